"""bf16 linear layers with their weights pre-packed for oneDNN, for the rollout's decode steps on a CPU.

A bf16 ``F.linear`` on a CPU runs a oneDNN matmul that re-lays out the weight into the blocked
format its AMX / AVX512-BF16 kernel reads, on every call. At a decode step's small M (a few dozen
rows) that reorder costs about as much as the multiplication itself. Packing each weight once
(``torch.ops.mkldnn._reorder_linear_weight``, what inductor's weight-prepacking pass does under
``freezing``) and calling the inner-product kernel on it (``torch.ops.mkldnn._linear_pointwise``)
skips it. The result is bit-for-bit the plain ``F.linear``'s (checked on every weight when it is packed,
so a CPU or build where it is not keeps the plain layer), so the sampled tokens do not change.

Only for a frozen copy that is re-packed whenever its weights change (the HF engine's cast rollout
copy, :class:`trajflow.engines.hf.HFRolloutEngine`): the packed tensor is a second copy that
autograd, ``state_dict`` and in-place updates of ``weight`` know nothing about. An untied layer's
``weight`` is emptied while packed (its storage would only duplicate the packed one);
:func:`unpack_linears` restores it exactly (``to_dense``).
"""

from __future__ import annotations

import types

import torch

_PACKED = "_trajflow_packed_weight"


def packing_available(dtype: torch.dtype, device) -> bool:
    """Whether this build and CPU can pack ``dtype`` weights on ``device`` (bf16 on a CPU with a
    oneDNN bf16 kernel; fp32 packing is not bit-identical to torch's MKL sgemm, so it is not used)."""
    if dtype != torch.bfloat16 or torch.device(device).type != "cpu":
        return False
    if not (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled):
        return False
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def _packed_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, getattr(self, _PACKED), self.bias, "none", [], "")


def shared_weights(model: torch.nn.Module) -> set[int]:
    """``id`` of every parameter used by more than one module (a tied LM head and input embedding)."""
    seen: dict[int, int] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            seen[id(p)] = seen.get(id(p), 0) + 1
    return {k for k, v in seen.items() if v > 1}


@torch.no_grad()
def pack_linears(model: torch.nn.Module, rows: int, check: bool = True) -> int:
    """Pack the weight of every ``torch.nn.Linear`` (exact type) of ``model`` whose weight is bf16 and
    non-empty (:func:`pack_linear`), the modules that are not packed yet.

    Returns:
        The number of layers packed by this call.
    """
    shared = shared_weights(model)
    return sum(pack_linear(m, rows, check, id(getattr(m, "weight", None)) not in shared) for m in model.modules())


@torch.no_grad()
def pack_linear(module: torch.nn.Module, rows: int, check: bool = True, free_weight: bool = True) -> bool:
    """Pack ``module``'s weight if it is a ``torch.nn.Linear`` (exact type) with a non-empty bf16 CPU
    weight not packed yet, and make its ``forward`` use the packed weight.

    With ``check``, the packed output on a random ``(rows, in_features)`` input must equal
    ``F.linear`` bit for bit, else the layer stays plain (a caller that re-packs the same layers after
    a weight change checks only the first time). With ``free_weight`` the plain weight is emptied
    (``weight.data`` of 0 elements, the dtype kept); pass ``False`` for a weight another module
    uses too (a tied LM head and input embedding, :func:`shared_weights`).

    Args:
        module: a module of a frozen model (no gradients flow through packed layers).
        rows: the batch size the packing is tuned for (decode slots).

    Returns:
        Whether the layer was packed.
    """
    w = getattr(module, "weight", None)
    if type(module) is not torch.nn.Linear or hasattr(module, _PACKED) or w is None \
            or w.dtype != torch.bfloat16 or w.numel() == 0 or w.device.type != "cpu":
        return False
    rows = max(1, int(rows))
    try:
        p = torch.ops.mkldnn._reorder_linear_weight(w.detach(), rows)
        if check:
            x = torch.randn(rows, w.shape[1], generator=torch.Generator().manual_seed(0)).to(w.dtype)
            if not torch.equal(torch.ops.mkldnn._linear_pointwise(x, p, module.bias, "none", [], ""),
                               torch.nn.functional.linear(x, w, module.bias)):
                return False
    except RuntimeError:
        return False
    setattr(module, _PACKED, p)
    module.forward = types.MethodType(_packed_forward, module)
    if free_weight:
        w.data = w.data.new_empty(0)
    return True


@torch.no_grad()
def unpack_linears(model: torch.nn.Module, restore: bool = True) -> None:
    """Undo :func:`pack_linears`: plain ``forward`` again, and (``restore``) every emptied weight
    filled from its packed copy (exactly); ``restore=False`` leaves emptied weights empty (their
    values are about to be replaced, e.g. by a weight sync)."""
    for module in model.modules():
        p = getattr(module, _PACKED, None)
        if p is None:
            continue
        if restore and module.weight.numel() == 0:
            module.weight.data = p.to_dense()
        delattr(module, _PACKED)
        del module.forward  # the instance attribute; the class's forward again


def dense_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``{name: tensor}`` of every parameter (``named_parameters``) as the layers use it: a packed
    layer's weight read back from its packed copy (exactly), the others as they are."""
    return _dense(model, dict(model.named_parameters()))


def dense_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with every packed layer's weight read back from its packed copy."""
    return _dense(model, dict(model.state_dict()))


def _dense(model: torch.nn.Module, out: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    for prefix, module in model.named_modules(remove_duplicate=False):
        p = getattr(module, _PACKED, None)
        name = f"{prefix}.weight" if prefix else "weight"
        if p is not None and module.weight.numel() == 0 and name in out:
            out[name] = p.to_dense()
    return out
