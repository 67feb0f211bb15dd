"""An RMSNorm whose backward keeps its input and one scalar per row, nothing of its own width.

Llama-style decoders (SmolLM2, Qwen 2/3, Mistral) normalise each token's hidden state twice per
layer with ``w * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)`` (Zhang & Sennrich 2019, "Root Mean
Square Layer Normalization", eq. 4), computed in float32. Autograd keeps, per norm and token, the
float32 input and the float32 normalised ``x_hat`` (for the product with ``w``) besides the row's
``rsqrt``: under a bf16 autocast over fp32 master weights the residual stream is float32, so these
are 2 x hidden float32 per norm and token. :class:`RMSNormFn` keeps the input and the per-row
``r = rsqrt(mean(x^2) + eps)`` only and recomputes ``x_hat`` in the backward (one elementwise pass).
Measured on the default recipe's micro-batch (1,275 response tokens, bf16 compute): the forward's
saved tensors shrink by ~0.31 GiB, 0.18 for the float32 copies and 0.13 for the shared bf16 inputs
(see ``docs/scaling.md``, "Memory of an update").

:func:`lean_norm` swaps it in for the duration of a training forward, as
:func:`trajflow.modeling.lean_mlp.lean_mlp` does for the MLPs. Plain functions over torch; no Ray,
no Prefect.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

#: RMSNorm classes computing exactly ``weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)`` in float32.
RMS_NORM_CLASSES = frozenset({"LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MistralRMSNorm"})


def _up(t: torch.Tensor) -> torch.Tensor:
    """``t`` in float32, or float64 if it is float64 (the models' own norms cast to float32; float64
    is kept so that finite-difference checks can run in it)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


class RMSNormFn(torch.autograd.Function):
    """``weight * (x * r).to(x.dtype)`` with ``r = rsqrt(mean(x^2, -1) + eps)`` in float32, saving
    ``x``, ``r`` ``(..., 1)`` and the weight only.

    Gradients (``x_hat = x r`` in float32, ``g`` the output's gradient, ``g_hat = g w``, means over
    the hidden axis; Zhang & Sennrich 2019, eq. 4 differentiated):
    ``dL/dw = sum over rows of g * x_hat`` and ``dL/dx = r (g_hat - x_hat mean(g_hat x_hat))``.

    ``apply(x, weight, eps, out_dtype=None)``: ``x`` ``(..., d)`` any float dtype; ``weight`` ``(d,)``.
    Returns ``(..., d)`` in the promoted dtype of ``weight`` and ``x`` (what the module's own product
    gives), or cast to ``out_dtype``. The input's gradient comes back in ``x``'s dtype, the weight's
    in the weight's.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype | None = None):
        xf = _up(x)
        r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        out = weight * (xf * r).to(x.dtype)
        ctx.out_dtype = out.dtype
        if out_dtype is not None:
            out = out.to(out_dtype)
        ctx.save_for_backward(x, weight, r)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight, r = ctx.saved_tensors
        grad_out = grad_out.to(ctx.out_dtype)
        xf = _up(x)
        x_hat = xf * r
        # The forward rounded x_hat to x's dtype before the product: the weight sees that value.
        grad_w = (grad_out * x_hat.to(x.dtype)).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
        # As autograd: the product's gradient is rounded to x_hat's dtype, then cast up to float32.
        g_hat = _up((grad_out * weight).to(x.dtype))
        grad_x = r * (g_hat - x_hat * (g_hat * x_hat).mean(-1, keepdim=True))
        return grad_x.to(x.dtype), grad_w, None, None


#: Norms whose output only feeds linear layers (the attention's q/k/v, the MLP's gate/up, the LM head).
LINEAR_INPUT_NORMS = frozenset({"input_layernorm", "post_attention_layernorm", "norm"})


def _lean_forward(norm: torch.nn.Module, feeds_linears: bool):
    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        device = hidden_states.device.type
        # Under autocast every linear casts its input to the compute dtype, each a copy of its own
        # that its backward keeps (q, k and v: three of the same norm output). Casting once here
        # gives the linears the same values and one saved tensor.
        out_dtype = torch.get_autocast_dtype(device) if feeds_linears and torch.is_autocast_enabled(device) else None
        return RMSNormFn.apply(hidden_states, norm.weight, float(norm.variance_epsilon), out_dtype)
    return forward


def lean_norm_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The norms of ``model`` :class:`RMSNormFn` computes exactly: a class of
    :data:`RMS_NORM_CLASSES` with a plain (not DeepSpeed ZeRO-3 partitioned) weight."""
    out = []
    for m in model.modules():
        if type(m).__name__ not in RMS_NORM_CLASSES:
            continue
        weight = getattr(m, "weight", None)
        if not isinstance(weight, torch.nn.Parameter) or hasattr(weight, "ds_id") or weight.dim() != 1:
            continue
        if not hasattr(m, "variance_epsilon"):
            continue
        out.append(m)
    return out


@contextlib.contextmanager
def lean_norm(model: torch.nn.Module) -> Iterator[int]:
    """Run the RMSNorms of ``model`` through :class:`RMSNormFn` inside this block when a backward can
    follow (grad mode on); yields how many norms were swapped (0: none, the model's own code runs).
    The swap is an instance attribute, removed on exit."""
    # Activation checkpointing recomputes each layer outside this block, and its recomputation must
    # save what the first forward saved.
    on = torch.is_grad_enabled() and not getattr(model, "is_gradient_checkpointing", False)
    norms = lean_norm_modules(model) if on else []
    names = {id(m): name.rsplit(".", 1)[-1] for name, m in model.named_modules()}
    for m in norms:
        m.forward = _lean_forward(m, names.get(id(m)) in LINEAR_INPUT_NORMS)
    try:
        yield len(norms)
    finally:
        for m in norms:
            m.__dict__.pop("forward", None)
