"""``trajflow export``: a checkpoint as a standard Hugging Face model folder.

A checkpoint (:mod:`trajflow.checkpoint`) holds what resume needs, in the layout of the strategy
that wrote it; this module turns the policy's weights of one checkpoint into what
``AutoModelForCausalLM.from_pretrained(OUT)`` loads (safetensors, ``config.json``,
``generation_config.json``, the tokenizer), as verl's model merger and TRL's ``save_pretrained`` do.
It runs in the calling process, on the CPU, without Ray, Prefect or a process group:

- one process: ``actor/model.safetensors`` holds every weight under the model's own names;
- LoRA (``model.lora_rank > 0``): ``actor/adapter.safetensors`` holds the adapter alone (peft's
  names); the frozen base is the model at the run's ``model.path``;
- FSDP2 (``actor.strategy=fsdp2``): ``actor/fsdp_rank<r>.safetensors`` holds rank r's dim-0 shard of
  each parameter (``fully_shard``'s ``Shard(0)``, ``torch.chunk`` sizes); the shards of one
  replica (the ranks of the mesh's last dimension) are concatenated in rank order and checked
  against the global shapes rank 0 recorded;
- DeepSpeed (``actor.strategy=deepspeed``): ``actor/deepspeed/latest/`` is DeepSpeed's own ZeRO
  checkpoint; its fp32 weights are consolidated with DeepSpeed's ``zero_to_fp32`` (the library's
  offline merger), with every ``.pt`` file read by ``torch.load(weights_only=True)``.

Under LoRA the folder holds the merged model ``W + s B A`` (peft's ``merge_and_unload``) by
default, plus the adapter in peft's format in ``OUT/adapter/`` (``PeftModel.from_pretrained(base,
OUT/adapter)``); ``lora="merged"`` or ``lora="adapter"`` writes one of the two.

Nothing read from the run folder runs code: the stored config only names the base model
(``model.path``, a directory or a built-in name; ``trust_remote_code`` is never set), the
checkpoint is verified against its manifest first, and no pickle is unpickled.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from trajflow.errors import StoreError

#: What ``lora=`` may ask for: the merged model, the adapter alone (peft format), or both.
LORA_MODES = ("both", "merged", "adapter")


def export_run(store_root: str | Path, run_id: str, iteration: int | None, out: str | Path,
               lora: str = "both", base: str | None = None) -> dict[str, Any]:
    """Export checkpoint ``iteration`` of run ``run_id`` to the folder ``out``.

    Args:
        store_root: the store root the run lives under.
        run_id: the run.
        iteration: the checkpoint's iteration; None = the newest complete one.
        out: the folder to write (must not exist, or be empty); written into a temp folder beside
            it and renamed into place when complete.
        lora: under LoRA, ``both`` (merged weights in ``out``, the adapter in ``out/adapter``),
            ``merged`` or ``adapter`` (``out`` is then peft's adapter folder).
        base: the base model instead of the stored ``model.path`` (it moved since the run).

    Returns:
        ``{"path", "iteration", "format", "lora", "files"}``.

    Raises:
        StoreError: no such run or checkpoint (names the ones there), a checkpoint that fails
            verification, ``out`` not empty, a bad ``lora`` value, weights that do not fit the model.
        trajflow.errors.ModelLoadError: the base model cannot be loaded.
    """
    from trajflow import checkpoint as ckpt
    from trajflow.store import RunStore, run_folders

    if lora not in LORA_MODES:
        raise StoreError(f"--lora {lora!r}: expected one of {', '.join(LORA_MODES)}")
    store = RunStore(store_root, run_id)
    if not store.exists():
        runs = [p.name for p in run_folders(store.root)][-10:]
        raise StoreError(f"no run {run_id!r} in store root {store.root} (runs there: {', '.join(runs) or 'none'}); "
                         f"pass --store DIR to look elsewhere")
    done = ckpt.list_checkpoints(store)
    if not done:
        raise StoreError(f"run {run_id!r} has no checkpoint (trainer.save_freq=0 writes none; its final model is "
                         f"{store.final_dir})")
    if iteration is None:
        iteration = done[-1]
    if iteration not in done:
        raise StoreError(f"run {run_id!r} has no checkpoint {iteration}; its checkpoints: "
                         f"{', '.join(map(str, done))}")
    why = ckpt.verify_checkpoint(store, iteration)
    if why:
        raise StoreError(f"checkpoint {iteration} of run {run_id!r} is not exported: {why}")
    model_cfg, strategy = _stored_model(store)
    if base is not None:
        model_cfg["path"] = base
    result = export_checkpoint(ckpt.checkpoint_dir(store, iteration) / "actor", model_cfg, out, lora=lora)
    return {**result, "iteration": iteration, "strategy": strategy}


def _stored_model(store: Any) -> tuple[dict, str]:
    """The run's ``model`` section (a plain dict, the schema's defaults filled in) and ``actor.strategy``."""
    from omegaconf import OmegaConf

    from trajflow.config.schema import ModelConfig

    cfg = store.read_config()
    try:
        section = OmegaConf.merge(OmegaConf.structured(ModelConfig), cfg.get("model") or {})
    except Exception as e:  # a damaged stored config: name it, never the library's internals
        raise StoreError(f"{store.config_path}: the model section does not parse ({type(e).__name__}: "
                         f"{str(e).splitlines()[0]})") from None
    actor = cfg.get("actor") or {}
    return OmegaConf.to_container(section, resolve=True), str(actor.get("strategy", "local"))


def export_checkpoint(actor_dir: str | Path, model_cfg: dict, out: str | Path, lora: str = "both") -> dict[str, Any]:
    """Write the policy weights of a checkpoint's ``actor/`` folder as a Hugging Face model folder.

    Args:
        actor_dir: ``<run>/checkpoints/<iteration>/actor`` (any strategy's layout, see the module doc).
        model_cfg: the run's ``model`` section (``path``, ``dtype``, ``cache_dir``, ``lora_*``,
            ``target_modules``).
        out: the folder to write (absent or empty).
        lora: see :func:`export_run`.

    Returns:
        ``{"path": str(out), "format": "single"|"lora"|"fsdp2"|"deepspeed", "lora": what was written
        ("merged", "adapter", "both" or None), "files": sorted file names}``.

    Raises:
        StoreError: ``out`` is not empty, or the weights do not fit the base model.
    """
    from trajflow.modeling import lora as lora_mod
    from trajflow.models import load_causal_lm, load_tokenizer, resolve_model_path

    d, out = Path(actor_dir), Path(out).expanduser().resolve()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise StoreError(f"{out} exists and is not an empty folder; choose a new output folder")
    fmt = _format(d)
    path = resolve_model_path(str(model_cfg["path"]), model_cfg.get("cache_dir"))
    model = load_causal_lm(path, str(model_cfg.get("dtype") or "float32"), "cpu",
                           str(model_cfg.get("attn_implementation") or "sdpa"))
    tokenizer = load_tokenizer(path)
    is_lora = lora_mod.lora_enabled(_Section(model_cfg))
    if is_lora:
        model = lora_mod.apply_lora(model, _Section(model_cfg))
    _load_weights(model, d, fmt, is_lora)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        written = None
        if not is_lora:
            model.save_pretrained(str(tmp), safe_serialization=True)
            tokenizer.save_pretrained(str(tmp))
        else:
            written = lora
            if lora in ("both", "adapter"):
                model.save_pretrained(str(tmp if lora == "adapter" else tmp / lora_mod.ADAPTER_DIR),
                                      safe_serialization=True)
            if lora in ("both", "merged"):
                model.merge_and_unload().save_pretrained(str(tmp), safe_serialization=True)
            tokenizer.save_pretrained(str(tmp))
        if out.exists():
            out.rmdir()  # empty (checked above)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    files = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    return {"path": str(out), "format": fmt, "lora": written, "files": files}


class _Section:
    """Attribute access over a plain ``model`` dict (what :mod:`trajflow.modeling.lora` reads)."""

    def __init__(self, values: dict) -> None:
        self.__dict__.update(values)


def _format(d: Path) -> str:
    from trajflow.checkpoint import weights_format

    fmt = weights_format(p.relative_to(d).as_posix() for p in d.rglob("*") if p.is_file())
    if fmt is None:
        raise StoreError(f"{d} holds no policy weights (model.safetensors, adapter.safetensors, fsdp_rank00000.safetensors "
                         f"or deepspeed/)")
    return fmt


def _load_weights(model: Any, d: Path, fmt: str, is_lora: bool) -> None:
    """Load the checkpoint's policy weights into ``model`` (the base model, peft-wrapped under LoRA)."""
    from safetensors.torch import load_file

    from trajflow.modeling import lora as lora_mod

    if fmt == "single" or fmt == "lora":
        if is_lora != (fmt == "lora"):
            raise StoreError(f"{d} holds a {'LoRA adapter' if fmt == 'lora' else 'full-weight'} checkpoint but the "
                             f"run's model.lora_rank says otherwise; the stored config does not match the checkpoint")
        state = load_file(str(d / ("adapter.safetensors" if is_lora else "model.safetensors")))
        if is_lora:
            try:
                lora_mod.load_adapter_state(model, state)
            except RuntimeError as e:
                raise StoreError(f"{d / 'adapter.safetensors'}: {e}") from None
            return
        _load_named(model, state, d / "model.safetensors")
        return
    if fmt == "fsdp2":
        state = _fsdp2_state(d)
    else:
        state = _deepspeed_state(d)
    # Under LoRA the sharded formats use the live (peft-wrapped) module's names; the checkpoint holds
    # the adapters alone when the base was frozen, so the base's weights stay those of model.path.
    _load_named(model, state, d, partial=is_lora)


def _load_named(model: Any, state: dict, where: Path, partial: bool = False) -> None:
    """``model.load_state_dict(state)``; every key must be the model's, and every model weight must
    be given (tied weights, which are one tensor, and, with ``partial``, frozen base weights excepted)."""
    own = model.state_dict()
    unexpected = sorted(set(state) - set(own))
    bad_shape = sorted(k for k in state if k in own and tuple(state[k].shape) != tuple(own[k].shape))
    if unexpected or bad_shape:
        raise StoreError(f"{where}: the weights do not fit the run's model.path (unexpected {unexpected[:3]}, "
                         f"other shapes {bad_shape[:3]}); pass --base with the model the run trained")
    tied = _tied_names(model)
    missing = sorted(k for k in set(own) - set(state) if k not in tied and not (partial and ".lora_" not in k))
    if missing:
        raise StoreError(f"{where}: the checkpoint lacks weights of the model: {missing[:3]}")
    model.load_state_dict(state, strict=False)


def _tied_names(model: Any) -> set[str]:
    """State-dict names that share storage with an earlier name (tied input/output embeddings)."""
    seen, tied = set(), set()
    for name, t in model.state_dict().items():
        key = (t.data_ptr(), tuple(t.shape))
        if key in seen:
            tied.add(name)
        seen.add(key)
    return tied


def _fsdp2_state(d: Path) -> dict:
    """Full parameters from an FSDP2 checkpoint (:meth:`trajflow.modeling.fsdp.FSDP2Backend.save`):
    each parameter's dim-0 shards of the first replica, concatenated in rank order."""
    import torch
    from safetensors import safe_open

    index = json.loads((d / "actor_state.json").read_text())
    if index.get("format") != "fsdp2":
        raise StoreError(f"{d / 'actor_state.json'}: format {index.get('format')!r}, expected 'fsdp2'")
    shapes, mesh = index["parameters"], index["mesh"]
    shard_ranks = int(mesh[-1])  # HSDP: the mesh is (replicate, shard); replica 0's ranks are 0..shard-1
    parts: dict[str, list] = {n: [] for n in shapes}
    for r in range(shard_ranks):
        tree = json.loads((d / f"fsdp_rank{r:05d}.json").read_text())["model"]
        with safe_open(str(d / f"fsdp_rank{r:05d}.safetensors"), "pt") as f:
            for n in shapes:
                parts[n].append(f.get_tensor(tree[n]["__tensor__"]))
    state = {}
    for n, shape in shapes.items():
        full = torch.cat(parts[n], dim=0) if len(shape) else parts[n][0]
        if list(full.shape) != list(shape):
            raise StoreError(f"{d}: the shards of {n} make {list(full.shape)}, rank 0 recorded {shape}")
        state[n] = full
    return state


def _deepspeed_state(d: Path) -> dict:
    """fp32 weights of a DeepSpeed ZeRO checkpoint (``actor/deepspeed/latest``), consolidated by
    DeepSpeed's ``zero_to_fp32``, under the trained module's names (the ``model.`` prefix of
    trajflow's packed-forward wrapper removed)."""
    import torch
    from deepspeed.utils import zero_to_fp32

    from trajflow.modeling.backends import deepspeed_safe_globals

    index = json.loads((d / "actor_state.json").read_text())
    if index.get("format") != "deepspeed":
        raise StoreError(f"{d / 'actor_state.json'}: format {index.get('format')!r}, expected 'deepspeed'")
    with _weights_only_torch_load(deepspeed_safe_globals()):
        state = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(
            str(d / "deepspeed"), tag="latest", exclude_frozen_parameters="lora_rank" in index)
    return {k[len("model."):] if k.startswith("model.") else k: v for k, v in state.items()
            if isinstance(v, torch.Tensor)}


@contextlib.contextmanager
def _weights_only_torch_load(safe_globals: list):
    """``torch.load`` that only ever reads tensors and plain containers (and ``safe_globals``) while
    DeepSpeed's merger runs: it asks for ``weights_only=False``, which would unpickle anything a
    tampered ``.pt`` file holds."""
    import torch

    original = torch.load

    def load(*args, **kwargs):
        kwargs["weights_only"] = True
        with torch.serialization.safe_globals(safe_globals):
            return original(*args, **kwargs)

    torch.load = load
    try:
        yield
    finally:
        torch.load = original
