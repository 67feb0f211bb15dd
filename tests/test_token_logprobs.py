"""The fused log-prob / entropy of the LM head's logits, against values worked out by hand."""

import math

import pytest
import torch

from trajflow.modeling.token_logprobs import token_logprobs_entropy

# softmax(log [1, 2, 3]) = [1/6, 2/6, 3/6]
P = [1 / 6, 2 / 6, 3 / 6]
H = -sum(p * math.log(p) for p in P)


def test_values_and_gradients_by_hand():
    x = torch.log(torch.tensor([[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]])).requires_grad_()
    labels = torch.tensor([2, 0])
    logp, ent = token_logprobs_entropy(x, labels, 1.0, entropy_grad=True)
    assert logp.dtype == ent.dtype == torch.float32
    assert logp.tolist() == pytest.approx([math.log(1 / 2), math.log(1 / 6)], abs=1e-6)
    assert ent.tolist() == pytest.approx([H, H], abs=1e-6)
    # d log p_y / dx_k = 1[k = y] - p_k (row 0, weight 1); d H / dx_k = -p_k (log p_k + H) (row 1, weight 1).
    (logp[0] + ent[1]).backward()
    assert x.grad[0].tolist() == pytest.approx([-1 / 6, -2 / 6, 1 - 3 / 6], abs=1e-6)
    assert x.grad[1].tolist() == pytest.approx([-p * (math.log(p) + H) for p in P], abs=1e-6)


def test_temperature_divides_the_logits_and_the_gradient():
    # logits 2 * log [1, 2, 3] at temperature 2 give the same distribution; the gradient is 1/tau as large.
    x = (2 * torch.log(torch.tensor([[1.0, 2.0, 3.0]]))).requires_grad_()
    logp, ent = token_logprobs_entropy(x, torch.tensor([1]), 2.0)
    assert logp.item() == pytest.approx(math.log(2 / 6), abs=1e-6)
    assert ent.item() == pytest.approx(H, abs=1e-6)
    assert not ent.requires_grad  # a metric unless entropy_grad
    logp.sum().backward()
    assert x.grad[0].tolist() == pytest.approx([-1 / 12, (1 - 2 / 6) / 2, -3 / 12], abs=1e-6)


def test_matches_log_softmax_on_a_large_vocabulary():
    torch.manual_seed(0)
    x = (torch.randn(5, 4000, dtype=torch.float64) * 4).requires_grad_()
    y = torch.randint(0, 4000, (5,))
    w_lp, w_h = torch.randn(5, dtype=torch.float64), torch.randn(5, dtype=torch.float64)
    lp, h = token_logprobs_entropy(x.float(), y, 0.7, entropy_grad=True)
    (lp.double() * w_lp + h.double() * w_h).sum().backward()
    got = x.grad.clone()
    x.grad = None
    ref_all = torch.log_softmax(x / 0.7, dim=-1)
    ref_lp = ref_all.gather(-1, y[:, None]).squeeze(-1)
    ref_h = -(ref_all.exp() * ref_all).sum(-1)
    (ref_lp * w_lp + ref_h * w_h).sum().backward()
    assert torch.allclose(lp.double(), ref_lp, atol=1e-5)
    assert torch.allclose(h.double(), ref_h, atol=1e-4)
    assert torch.allclose(got, x.grad, atol=1e-6)


def test_second_backward_through_the_saved_softmax_is_refused():
    x = torch.randn(2, 5, requires_grad=True)
    logp, _ = token_logprobs_entropy(x, torch.tensor([0, 1]))
    logp.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="runs once"):
        logp.sum().backward()


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="temperature must be > 0"):
        token_logprobs_entropy(torch.zeros(2, 3), torch.tensor([0, 1]), 0.0)
    with pytest.raises(ValueError, match=r"logits \(n, vocab\) and labels \(n,\)"):
        token_logprobs_entropy(torch.zeros(2, 3), torch.tensor([0]))


def test_bf16_logits_are_kept_instead_of_the_float32_softmax():
    # log [1, 2, 4] is exact in bf16 up to its rounding; the gradient of log p_y is 1[k = y] - p_k
    # with p = softmax of the bf16 values, whichever of the two is saved.
    x16 = torch.log(torch.tensor([[1.0, 2.0, 4.0], [1.0, 2.0, 4.0]])).to(torch.bfloat16).requires_grad_()
    x32 = x16.detach().float().requires_grad_()
    labels = torch.tensor([2, 0])
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        lp16, h16 = token_logprobs_entropy(x16, labels, 0.5)
    assert [t.dtype for t in saved if t.is_floating_point()] == [torch.bfloat16]  # the logits, not p
    lp32, h32 = token_logprobs_entropy(x32, labels, 0.5)
    assert torch.equal(lp16, lp32) and torch.equal(h16, h32)
    lp16.sum().backward()
    lp32.sum().backward()
    assert x16.grad.dtype == torch.bfloat16
    assert torch.equal(x16.grad, x32.grad.to(torch.bfloat16))  # the softmax recomputed bit for bit
    p = torch.softmax(x32.detach() / 0.5, dim=-1)
    want = (-p + torch.nn.functional.one_hot(labels, 3)) / 0.5
    assert torch.allclose(x32.grad, want, atol=1e-6)


@pytest.mark.parametrize("dtype,entropy_grad", [(torch.bfloat16, False), (torch.float32, False),
                                                (torch.float32, True)])
def test_row_blocks_give_the_values_and_gradients_of_one_pass(monkeypatch, dtype, entropy_grad):
    """The float32 softmax is computed ``ROW_BLOCK`` rows at a time (its size bounds the backward's
    first allocation); each row's operations are its own, so blocks of 7 rows give the values and
    gradients of one pass over all 30 bit for bit, and both match log_softmax in float64."""
    import trajflow.modeling.token_logprobs as tl

    torch.manual_seed(1)
    x = (torch.randn(30, 3000) * 3).to(dtype)
    y = torch.randint(0, 3000, (30,))
    w_lp, w_h = torch.randn(30), torch.randn(30)
    runs = []
    for block in (7, 10**6):
        monkeypatch.setattr(tl, "ROW_BLOCK", block)
        xx = x.clone().requires_grad_()
        lp, h = token_logprobs_entropy(xx, y, 0.7, entropy_grad=entropy_grad)
        ((lp * w_lp).sum() + ((h * w_h).sum() if entropy_grad else 0)).backward()
        runs.append((lp.detach(), h.detach(), xx.grad))
    (lp7, h7, g7), (lp1, h1, g1) = runs
    assert torch.equal(lp7, lp1) and torch.equal(h7, h1) and torch.equal(g7, g1)
    ref = torch.log_softmax(x.double() / 0.7, dim=-1)
    assert torch.allclose(lp7.double(), ref.gather(-1, y[:, None]).squeeze(-1), atol=1e-4)
    assert torch.allclose(h7.double(), -(ref.exp() * ref).sum(-1), atol=1e-3)
