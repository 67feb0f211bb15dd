"""Checkpoints: everything needed to continue a run exactly where it stopped.

``<run>/checkpoints/000008/`` holds the state *after* iteration 8:

- ``actor/model.safetensors`` and ``actor/actor_state.{safetensors,json}`` (optimizer, policy
  version, RNG states), written by the policy worker; under LoRA (``model.lora_rank > 0``)
  ``actor/adapter.safetensors`` (the adapter's ``lora_`` tensors only) replaces the weights and the
  optimizer state is the adapter's, so the checkpoint is megabytes;
- ``critic/model.safetensors`` and ``critic/critic_state.{safetensors,json}`` (value model and its
  optimizer), when the run trains a critic (``algorithm.adv_estimator=gae``);
- ``manifest.json``: sha256 and size of every file above; resume verifies them before loading;
- ``trainer_state.json``: iteration, data cursor (prompt sampler state), KL controller state,
  score history for drift gates, MLflow run id.

Nothing in a checkpoint is a pickle (:mod:`trajflow.state_files`), so a tampered checkpoint cannot
run code; one that fails its manifest is skipped on resume, with the file named.

A checkpoint is written into a hidden temp folder and renamed into place only when complete, so a
crash mid-write leaves no folder that looks like a checkpoint. Rotation keeps the newest
``max_checkpoints`` (by iteration) up to the one just written, never deletes that one, and leaves
later ones (a resume went back past them) alone; a folder is renamed to a
hidden name before it is deleted, so a crash mid-deletion leaves no half-deleted checkpoint that
still looks complete. :func:`cleanup` removes the hidden leftovers of killed writers.

With ``trainer.keep_best=<metric>`` rotation also keeps the best checkpoint by a validation metric
(:func:`best_checkpoint`): a checkpoint is scored by the validation of its own iteration, which
``run.json`` holds as ``validation_<iteration>`` (validation runs before the checkpoint is saved);
checkpoints of iterations without a validation, or without the metric, have no score.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Iterable

from trajflow.faults import fault_point
from trajflow.store import RunStore, _fsync_dir, atomic_write_json, follow_umask

STATE_FILE = "trainer_state.json"
MANIFEST = "manifest.json"


def list_checkpoints(store: RunStore) -> list[int]:
    """Iterations that have a complete checkpoint, ascending."""
    d = store.checkpoints_dir()
    if not d.exists():
        return []
    return sorted(int(p.name) for p in d.iterdir()
                  if p.is_dir() and p.name.isdigit() and (p / STATE_FILE).exists())


def latest_checkpoint(store: RunStore) -> int | None:
    """The newest complete checkpoint's iteration, or ``None``."""
    done = list_checkpoints(store)
    return done[-1] if done else None


def checkpoint_dir(store: RunStore, iteration: int) -> Path:
    return store.checkpoints_dir() / f"{iteration:06d}"


def save_checkpoint(store: RunStore, iteration: int, trainer_state: dict[str, Any],
                    save_workers: Callable[[Path], None], max_checkpoints: int = 0,
                    keep_best: tuple[str, str] | None = None) -> Path:
    """Write a complete checkpoint for ``iteration`` and rotate old ones.

    Args:
        store: the run store.
        iteration: the iteration just finished.
        trainer_state: JSON-serialisable driver state (data cursor, controllers, ...).
        save_workers: called with the temp folder; workers write their state below it.
        max_checkpoints: keep this many newest checkpoints (0 = all).
        keep_best: ``(metric, "max"|"min")``: also keep the best checkpoint by that validation metric.

    Returns:
        The checkpoint folder.
    """
    final = checkpoint_dir(store, iteration)
    tmp = final.with_name(f".tmp-{final.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_workers(tmp)
    follow_umask(tmp)
    fault_point("checkpoint", iteration)
    atomic_write_json(tmp / MANIFEST, {"files": _file_hashes(tmp)})
    atomic_write_json(tmp / STATE_FILE, {**trainer_state, "iteration": iteration})
    old = None
    if final.exists():  # an earlier attempt of the same iteration completed: swap it out whole
        old = final.with_name(f".old-{final.name}")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    _fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    rotate(store, max_checkpoints, keep=[best_checkpoint(store, *keep_best)] if keep_best else (), through=iteration)
    return final


def checkpoint_scores(store: RunStore, metric: str) -> dict[int, float]:
    """The finite values of validation ``metric`` at the iterations of the complete checkpoints
    (``run.json``'s ``validation_<iteration>``), by iteration."""
    import math

    from trajflow.metric_names import metric_name, metric_names

    meta = store.read_run_meta()
    out, metric = {}, metric_name(metric)  # verl's 'mean@1' and 'mean_at_1' are the same metric
    for it in list_checkpoints(store):
        value = metric_names(meta.get(f"validation_{it:06d}") or {}).get(metric)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            out[it] = float(value)
    return out


def best_checkpoint(store: RunStore, metric: str, mode: str = "max") -> int | None:
    """The iteration of the complete checkpoint with the best validation ``metric`` (``mode``: ``max``
    or ``min``; ties to the earlier checkpoint), or ``None`` when no checkpoint has a score.

    Raises:
        ValueError: ``mode`` is neither ``max`` nor ``min``.
    """
    if mode not in ("max", "min"):
        raise ValueError(f"trainer.keep_best_mode must be 'max' or 'min', got {mode!r}")
    scores = checkpoint_scores(store, metric)
    if not scores:
        return None
    sign = 1.0 if mode == "max" else -1.0
    return max(sorted(scores), key=lambda it: sign * scores[it])  # max keeps the first (earliest) of equals


def rotate(store: RunStore, max_checkpoints: int, keep: Any = (), through: int | None = None) -> list[int]:
    """Delete all but the newest ``max_checkpoints`` complete checkpoints up to iteration ``through``
    and the iterations in ``keep`` (the best one, :func:`best_checkpoint`; ``None`` entries are
    ignored); return the deleted ones.

    Checkpoints after ``through`` (the iteration just saved) are neither counted nor deleted: a run
    that resumed from an older checkpoint (the newer ones failed verification) left them, and they
    are replaced when the run reaches their iteration again. Counting them deleted the good
    checkpoint just written and kept the broken one, leaving nothing loadable.
    """
    done = [it for it in list_checkpoints(store) if through is None or it <= through]
    if max_checkpoints <= 0 or len(done) <= max_checkpoints:
        return []
    kept = {int(k) for k in keep if k is not None}
    doomed = [it for it in done[:-max_checkpoints] if it not in kept]  # never includes done[-1], the newest
    for it in doomed:
        d = checkpoint_dir(store, it)
        trash = d.with_name(f".del-{d.name}")
        shutil.rmtree(trash, ignore_errors=True)
        os.replace(d, trash)  # atomic: the checkpoint is either complete or gone
        shutil.rmtree(trash, ignore_errors=True)
    return doomed


def cleanup(store: RunStore) -> list[Path]:
    """Delete hidden leftovers (``.tmp-*``, ``.old-*``, ``.del-*``) of killed checkpoint writers.

    Returns:
        The folders removed.
    """
    d = store.checkpoints_dir()
    if not d.exists():
        return []
    removed = []
    for p in sorted(d.iterdir()):
        if not (p.is_dir() and p.name.startswith((".tmp-", ".old-", ".del-"))):
            continue
        final = d / p.name[5:]
        if p.name.startswith(".old-") and not final.exists() and (p / STATE_FILE).exists():
            os.replace(p, final)  # killed between swapping a checkpoint out and the new one in
            continue
        shutil.rmtree(p, ignore_errors=True)
        removed.append(p)
    return removed


def _file_hashes(d: Path) -> dict[str, dict[str, Any]]:
    import hashlib

    out = {}
    for p in sorted(d.rglob("*")):
        if p.is_file() and p.name not in (MANIFEST, STATE_FILE):
            h = hashlib.sha256()
            with open(p, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 22), b""):
                    h.update(chunk)
            out[str(p.relative_to(d))] = {"sha256": h.hexdigest(), "bytes": p.stat().st_size}
    return out


def verify_checkpoint(store: RunStore, iteration: int) -> str | None:
    """Why checkpoint ``iteration`` must not be loaded, or None when every file matches its manifest.

    Checks that ``trainer_state.json`` parses and that every file the manifest lists exists with its
    size and sha256, and no other file is there (a checkpoint written before manifests existed has
    none). The manifest is an integrity check, not authentication (anyone who can write the folder
    can rewrite it), so the contents are checked as data as well: the policy's weights are there,
    every safetensors header and JSON file parses, ``policy_version`` is an integer.
    """
    d = checkpoint_dir(store, iteration)
    try:
        state = json.loads((d / STATE_FILE).read_text())
        if not isinstance(state, dict) or "policy_version" not in state:
            return f"{d / STATE_FILE} is not a trainer state (no policy_version)"
    except (OSError, ValueError) as e:
        return f"{d / STATE_FILE} is unreadable ({type(e).__name__})"
    if not (d / MANIFEST).exists():
        old = sorted(d.glob("*/*_state.pt"))
        if old:  # written by a trajflow that stored optimizer/RNG state as torch pickles
            return f"{old[0]} is a pickle (an older checkpoint format); it is not loaded, since a pickle can run code"
        return _check_contents(d, state, sorted(_file_hashes(d)))  # no manifest: still checked as data
    try:
        listed = json.loads((d / MANIFEST).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{d / MANIFEST} is unreadable ({type(e).__name__})"
    if not isinstance(listed, dict) or not all(isinstance(v, dict) for v in listed.values()):
        return f"{d / MANIFEST} is not a checkpoint manifest (expected files: {{path: {{sha256, bytes}}}})"
    actual = _file_hashes(d)
    for rel, want in sorted(listed.items()):
        got = actual.get(rel)
        if got is None:
            return f"{d / rel} is missing"
        if got != want:
            return f"{d / rel} does not match the checkpoint's manifest (truncated or changed)"
    # A manifest is an integrity check, not authentication: whoever can write the folder can rewrite
    # it to match their files. So what the workers will load is checked as data too.
    unlisted = sorted(set(actual) - set(listed) - {MANIFEST, STATE_FILE})
    if unlisted:
        return f"{d / unlisted[0]} is not in the checkpoint's manifest"
    return _check_contents(d, state, sorted(listed))


def weights_format(actor_files: Iterable[str]) -> str | None:
    """How a checkpoint's ``actor/`` folder holds the policy weights, from the file names in it
    (relative to ``actor/``): ``"fsdp2"`` (rank shards, :meth:`trajflow.modeling.fsdp.FSDP2Backend.save`),
    ``"deepspeed"`` (``deepspeed/``), ``"lora"`` (the adapter alone), ``"single"`` (the whole model),
    or None when none is there."""
    names = set(actor_files)
    if "fsdp_rank00000.safetensors" in names:
        return "fsdp2"
    if any(n.startswith("deepspeed/") for n in names):
        return "deepspeed"
    if "adapter.safetensors" in names:
        return "lora"
    if "model.safetensors" in names:
        return "single"
    return None


def _check_contents(d: Path, state: dict, files: list[str]) -> str | None:
    """Why the files of checkpoint folder ``d`` cannot be what trajflow wrote, or None: the policy's
    weights and state are there, every safetensors header and JSON file parses, the trainer
    state's versions are integers."""
    from safetensors import safe_open

    if not isinstance(state.get("policy_version"), int) or isinstance(state.get("policy_version"), bool):
        return f"{d / STATE_FILE}: policy_version={state.get('policy_version')!r} is not an integer"
    if weights_format(f[len("actor/"):] for f in files if f.startswith("actor/")) is None:
        return (f"{d / 'actor'} holds no policy weights (model.safetensors, adapter.safetensors, FSDP2's "
                f"fsdp_rank00000.safetensors or DeepSpeed's deepspeed/)")
    for rel in files:
        path = d / rel
        try:
            if rel.endswith(".safetensors"):
                with safe_open(str(path), framework="pt") as st:
                    st.keys()
            elif rel.endswith(".json") and not isinstance(json.loads(path.read_text()), dict):
                return f"{path} does not hold a JSON object"
        except Exception as e:  # safetensors' SafetensorError, a JSON error, an OSError
            return f"{path} is not readable ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    return None


def newest_verified_checkpoint(store: RunStore) -> tuple[int | None, list[tuple[int, str]]]:
    """The newest checkpoint that verifies, and the newer ones skipped with the reason for each."""
    skipped = []
    for it in reversed(list_checkpoints(store)):
        why = verify_checkpoint(store, it)
        if why is None:
            return it, skipped
        skipped.append((it, why))
    return None, skipped


def checkpoint_id(iteration: int | None) -> str:
    """How audit rows and manifests name a checkpoint: ``checkpoints/000004``, or ``initial``."""
    return "initial" if iteration is None else f"checkpoints/{iteration:06d}"


def read_trainer_state(store: RunStore, iteration: int) -> dict[str, Any]:
    return json.loads((checkpoint_dir(store, iteration) / STATE_FILE).read_text())


def state_digest(state: dict) -> str:
    """sha256 over a state dict's names and raw tensor bytes, in name order (compares weights bit for bit)."""
    import hashlib

    h = hashlib.sha256()
    for k, v in sorted(state.items()):
        h.update(k.encode())
        h.update(v.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()
