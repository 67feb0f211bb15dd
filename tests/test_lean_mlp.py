"""The gated MLP of the training forward (trajflow.modeling.lean_mlp): the same gradients as
autograd through the model's own MLP, with half of its saved intermediate tensors."""

import pytest
import torch

from trajflow.modeling.lean_mlp import SwiGLUDown, lean_mlp, lean_mlp_modules
from trajflow.modeling.packing import pack
from trajflow.models import load_causal_lm
from tests.saved_tensors import training_grads


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


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-5), ("bfloat16", 2e-2)])
def test_training_forward_with_lean_mlp_gives_the_same_gradients_and_saves_less(tiny_model_dir, dtype, tol):
    model = load_causal_lm(str(tiny_model_dir), "float32", "cpu", "sdpa")
    model.train()
    assert len(lean_mlp_modules(model)) == model.config.num_hidden_layers
    packed = pack([[5, 6, 7, 8], [5, 6, 9]], [[10, 11, 12], [13, 14]], 0)
    ref, logp_ref, saved_ref = training_grads(model, packed, dtype)
    got, logp, saved = training_grads(model, packed, dtype, lean_mlp, model.config.num_hidden_layers)
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
