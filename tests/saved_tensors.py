"""Shared by the lean-layer tests: one training forward of a micro-batch, its gradients and how many
bytes autograd saved for the backward."""

import contextlib

import torch

from trajflow.modeling.forward import forward_micro_batch
from trajflow.modeling.precision import autocast


def training_grads(model, packed, dtype: str, swap=None, swaps: int | None = None):
    """``(grads by parameter name, log-probs, saved bytes)`` of ``logp.sum()``'s backward.

    Args:
        swap: a context manager factory (``lean_mlp``, ``lean_norm``) entered around the forward, or
            None for the model's own layers.
        swaps: how many modules ``swap`` must report having swapped.

    Saved bytes count each storage once and leave the parameters out.
    """
    model.zero_grad(set_to_none=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.untyped_storage()) or t, lambda t: t):
        with autocast(dtype, "cpu"), (swap(model) if swap else contextlib.nullcontext()) as n:
            if swap is not None:
                assert n == swaps
            logp, _ = forward_micro_batch(model, packed, 1.0)
    logp.sum().backward()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    nbytes = sum(s.nbytes() for s in {s.data_ptr(): s for s in saved if s.data_ptr() not in params}.values())
    return {k: p.grad.clone() for k, p in model.named_parameters()}, logp.detach(), nbytes
