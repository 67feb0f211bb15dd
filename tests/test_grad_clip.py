"""Gradient clipping in the single-process backend, fused AdamW or not, against clipping by hand."""

import math

import pytest
import torch

from trajflow.modeling.backends import LocalBackend, adamw


def _backend(fused: bool):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = adamw(model.parameters(), 1e-2, device="cpu") if fused else torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    # Gradients with a known norm: weight all 2.0 (6 entries), bias all 1.0 (2 entries) -> sqrt(24 + 2).
    model.weight.grad = torch.full((2, 3), 2.0)
    model.bias.grad = torch.full((2,), 1.0)
    return model, opt, LocalBackend(model, opt)


@pytest.mark.parametrize("fused", [True, False])
def test_clipped_gradient_reaches_the_optimizer(fused):
    model, opt, backend = _backend(fused)
    assert bool(opt.defaults.get("fused")) is fused
    norm = math.sqrt(26.0)
    gn, stepped = backend.step(grad_clip=1.0)
    assert stepped and gn == pytest.approx(norm, rel=1e-6)
    # AdamW's first moment after one step is (1 - beta1) * g with g the clipped gradient g * 1 / norm.
    coef = 1.0 / (norm + 1e-6)
    assert opt.state[model.weight]["exp_avg"] == pytest.approx(torch.full((2, 3), 0.1 * 2.0 * coef), rel=1e-5)
    assert opt.state[model.bias]["exp_avg"] == pytest.approx(torch.full((2,), 0.1 * 1.0 * coef), rel=1e-5)
    assert not hasattr(opt, "grad_scale")  # the factor is for this step only


@pytest.mark.parametrize("fused", [True, False])
def test_norm_below_the_threshold_is_not_scaled(fused):
    model, opt, backend = _backend(fused)
    gn, stepped = backend.step(grad_clip=10.0)
    assert stepped and gn == pytest.approx(math.sqrt(26.0), rel=1e-6)
    assert opt.state[model.weight]["exp_avg"] == pytest.approx(torch.full((2, 3), 0.2), rel=1e-5)


def test_no_clipping_and_a_non_finite_norm():
    model, opt, backend = _backend(True)
    gn, stepped = backend.step(grad_clip=0.0)
    assert stepped and opt.state[model.bias]["exp_avg"] == pytest.approx(torch.full((2,), 0.1), rel=1e-5)
    before = model.weight.detach().clone()
    model.weight.grad = torch.full((2, 3), float("nan"))
    gn, stepped = backend.step(grad_clip=1.0)
    assert not stepped and not math.isfinite(gn)
    assert torch.equal(model.weight.detach(), before)
