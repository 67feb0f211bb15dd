"""The gated MLP of the training forward (trajflow.modeling.lean_mlp): the same gradients as
autograd through the model's own MLP, with half of its saved intermediate tensors."""

import pytest
import torch

from trajflow.modeling.lean_mlp import SwiGLUDown, lean_mlp, lean_mlp_modules
from trajflow.modeling.packing import pack
from trajflow.modeling.forward import forward_micro_batch
from trajflow.modeling.precision import autocast
from trajflow.models import load_causal_lm


def _reference(g, u, w, b):
    # The model's own formula, through autograd: down(silu(gate) * up).
    return torch.nn.functional.linear(torch.nn.functional.silu(g) * u, w, b)


@pytest.mark.parametrize("bias", [False, True])
def test_swiglu_down_gradients_match_autograd(bias):
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(2, 5, 12, generator=gen, dtype=torch.float64, requires_grad=True)
    u = torch.randn(2, 5, 12, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(7, 12, generator=gen, dtype=torch.float64, requires_grad=True)
    b = torch.randn(7, generator=gen, dtype=torch.float64, requires_grad=True) if bias else None
    inputs = (g, u, w) + ((b,) if bias else ())
    # Finite differences, independent of both implementations.
    assert torch.autograd.gradcheck(lambda *a: SwiGLUDown.apply(a[0], a[1], a[2], a[3] if bias else None), inputs)
    out = SwiGLUDown.apply(g, u, w, b)
    ref = _reference(g, u, w, b)
    assert torch.allclose(out, ref, atol=1e-12)


def _grads(model, packed, dtype, lean):
    model.zero_grad(set_to_none=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.untyped_storage()) or t, lambda t: t):
        with autocast(dtype, "cpu"):
            if lean:
                with lean_mlp(model) as n:
                    assert n == model.config.num_hidden_layers
                    logp, _ = forward_micro_batch(model, packed, 1.0)
            else:
                logp, _ = forward_micro_batch(model, packed, 1.0)
    logp.sum().backward()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    nbytes = sum(s.nbytes() for s in {s.data_ptr(): s for s in saved if s.data_ptr() not in params}.values())
    return {k: p.grad.clone() for k, p in model.named_parameters()}, logp.detach(), nbytes


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-5), ("bfloat16", 2e-2)])
def test_training_forward_with_lean_mlp_gives_the_same_gradients_and_saves_less(tiny_model_dir, dtype, tol):
    model = load_causal_lm(str(tiny_model_dir), "float32", "cpu", "sdpa")
    model.train()
    assert len(lean_mlp_modules(model)) == model.config.num_hidden_layers
    packed = pack([[5, 6, 7, 8], [5, 6, 9]], [[10, 11, 12], [13, 14]], 0)
    ref, logp_ref, saved_ref = _grads(model, packed, dtype, lean=False)
    got, logp, saved = _grads(model, packed, dtype, lean=True)
    assert torch.equal(logp, logp_ref)  # the forward computes the same values
    for k in ref:
        assert got[k].dtype == ref[k].dtype == torch.float32, k
        scale = ref[k].abs().max().clamp(min=1e-6)
        assert ((got[k] - ref[k]).abs().max() / scale) < tol, k
    # Per layer the MLP kept gate, silu(gate), up and the product (4 x d_ff per token); now gate and up.
    # Tree packing runs 8 tokens: the common prefix [5, 6], the rests [7, 8] and [9], and each
    # response but its last token ([10, 11] and [13]).
    tokens = 2 + 2 + 1 + 2 + 1
    d_ff, layers = model.config.intermediate_size, model.config.num_hidden_layers
    itemsize = 4 if dtype == "float32" else 2
    assert saved_ref - saved >= 2 * tokens * d_ff * itemsize * layers * 0.9, (saved_ref, saved)
    assert all("forward" not in m.__dict__ for m in lean_mlp_modules(model))  # swapped back


def test_lean_mlp_is_off_without_grad_and_under_activation_checkpointing(tiny_model_dir):
    model = load_causal_lm(str(tiny_model_dir), "float32", "cpu", "sdpa")
    model.train()
    with torch.no_grad(), lean_mlp(model) as n:
        assert n == 0
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    with lean_mlp(model) as n:
        assert n == 0
