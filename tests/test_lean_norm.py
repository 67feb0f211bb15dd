"""The RMSNorm of the training forward (trajflow.modeling.lean_norm): the gradients of autograd
through the model's own norm, with the normalised copy of each hidden state no longer saved."""

import pytest
import torch

from trajflow.modeling.lean_mlp import lean_mlp
from trajflow.modeling.lean_norm import RMSNormFn, lean_norm, lean_norm_modules
from trajflow.modeling.packing import pack
from trajflow.models import load_causal_lm
from tests.saved_tensors import training_grads


def test_rms_norm_gradients_match_finite_differences():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 12, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(12, generator=gen, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: RMSNormFn.apply(a, b, 1e-6), (x, w))
    # The forward by hand: w_j x_ij / sqrt(mean_j x_ij^2 + eps).
    want = w * x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6)
    assert torch.allclose(RMSNormFn.apply(x, w, 1e-6), want, atol=1e-12)


def test_rms_norm_gradient_of_a_row_by_hand():
    # d = 2, x = (3, 4), w = (1, 1), eps = 0: r = 1 / sqrt(12.5), x_hat = (3, 4) r.
    # For L = y_0 (g = (1, 0)): dL/dx = r (g - x_hat mean(g x_hat)) = r ((1, 0) - x_hat * 3 r / 2).
    x = torch.tensor([[3.0, 4.0]], dtype=torch.float64, requires_grad=True)
    w = torch.ones(2, dtype=torch.float64, requires_grad=True)
    RMSNormFn.apply(x, w, 0.0)[0, 0].backward()
    r = 12.5 ** -0.5
    want = [r * (1 - 3 * r * 3 * r / 2), r * (0 - 4 * r * 3 * r / 2)]  # (0.0905, -0.0679)
    assert torch.allclose(x.grad[0], torch.tensor(want, dtype=torch.float64), atol=1e-12)
    assert torch.allclose(w.grad, torch.tensor([3 * r, 0.0], dtype=torch.float64), atol=1e-12)


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-5), ("bfloat16", 2e-2)])
def test_training_forward_with_lean_norm_gives_the_same_gradients_and_saves_less(tiny_model_dir, dtype, tol):
    model = load_causal_lm(str(tiny_model_dir), "float32", "cpu", "sdpa")
    model.train()
    packed = pack([[5, 6, 7, 8], [5, 6, 9]], [[10, 11, 12], [13, 14]], 0)
    ref, logp_ref, saved_ref = training_grads(model, packed, dtype)
    got, logp, saved = training_grads(model, packed, dtype, lean_norm, 2 * model.config.num_hidden_layers + 1)
    assert torch.equal(logp, logp_ref)  # the forward computes the same values
    for k in ref:
        assert got[k].dtype == ref[k].dtype == torch.float32, k
        scale = ref[k].abs().max().clamp(min=1e-6)
        assert ((got[k] - ref[k]).abs().max() / scale) < tol, k
    # Each norm kept its float32 input and x_hat (the residual stream is float32 under autocast
    # over fp32 weights too); now the input only. Tree packing runs 8 tokens: the common prefix
    # [5, 6], the rests [7, 8] and [9], and each response but its last token ([10, 11] and [13]).
    tokens, hidden = 2 + 2 + 1 + 2 + 1, model.config.hidden_size
    layers = model.config.num_hidden_layers
    want = (2 * layers + 1) * tokens * hidden * 4
    if dtype == "bfloat16":
        # Under autocast q, k, v (and gate, up) each kept a bf16 cast of the same norm output; now
        # they share the one the norm returns: 3 fewer bf16 copies per layer and token.
        want += 3 * layers * tokens * hidden * 2
    assert saved_ref - saved >= want * 0.9, (saved_ref, saved, want)
    assert all("forward" not in m.__dict__ for m in lean_norm_modules(model))  # swapped back


@pytest.mark.parametrize("swap", [lean_norm, lean_mlp])
def test_lean_layers_are_off_without_grad_and_under_activation_checkpointing(tiny_model_dir, swap):
    model = load_causal_lm(str(tiny_model_dir), "float32", "cpu", "sdpa")
    model.train()
    with torch.no_grad(), swap(model) as n:
        assert n == 0
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    with swap(model) as n:
        assert n == 0
