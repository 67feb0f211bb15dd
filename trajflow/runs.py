"""The runs of a store root, one summary row each (``trajflow runs``).

Everything is read from the run folders (``run.json``, ``iterations/``, ``checkpoints/``); nothing
is imported or executed from them, and a damaged ``run.json`` makes its row say so instead of
failing the listing.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from trajflow.checkpoint import list_checkpoints
from trajflow.errors import StoreError
from trajflow.metric_names import metric_names
from trajflow.store import RunStore, run_folders

__all__ = ["folder_bytes", "format_bytes", "list_runs", "format_runs"]


def folder_bytes(path: Path) -> int:
    """Bytes a file or folder takes (apparent sizes, each hard-linked inode once); 0 when missing."""
    path = Path(path)
    if not path.exists():
        return 0
    if path.is_file():
        return path.stat().st_size
    seen, total = set(), 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except OSError:
                continue
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_size
    return total


def format_bytes(n: int) -> str:
    """``1.6 GB``, ``4.1 MB``, ``812 B`` (powers of 1000, as ``du --si``)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _last_validation(meta: dict) -> tuple[int | None, str | None, float | None]:
    """(iteration, metric, value) of the newest ``validation_NNNNNN`` entry's first ``val-core/`` metric."""
    keys = sorted(k for k in meta if k.startswith("validation_") and k[11:].isdigit())
    for key in reversed(keys):
        entry = meta[key] if isinstance(meta[key], dict) else {}
        entry = metric_names(entry)  # a run written before the one spelling: '@' -> '_at_'
        core = sorted(k for k in entry if k.startswith("val-core/"))
        if core:
            return int(key[11:]), core[0], float(entry[core[0]])
    return None, None, None


def driver_holds_lock(store: RunStore) -> bool | None:
    """Whether a driver on this machine holds the run's lock (``trajflow.store.run_lock``); None when
    that cannot be known (the holder was on another host, or there is no record of one).

    Read-only: the kernel's lock table (``/proc/locks``) is searched for the lock file's inode, so
    listing never takes the lock a starting driver is about to take. A SIGKILLed driver's lock is
    released by the kernel, so its run shows as not held.
    """
    try:
        holder = json.loads((store.run_dir / ".lock.json").read_text())
        inode = (store.run_dir / ".lock").stat().st_ino
        table = open("/proc/locks").read()
    except (OSError, ValueError):
        return None
    if not isinstance(holder, dict) or holder.get("host") != socket.gethostname():
        return None
    suffix = f":{inode}"
    return any(field.endswith(suffix) and field.count(":") == 2 for line in table.splitlines()
               for field in line.split())


def list_runs(root: str | Path) -> list[dict[str, Any]]:
    """One row per run folder under ``root`` (a folder holding ``config.yaml``), oldest first.

    Each row: ``run_id``, ``kind`` (``train`` or ``replay``), ``parent_run_id`` (replays), ``recipe``,
    ``status`` (``run.json``'s: running, finished, failed, interrupted; ``killed`` when it says
    running but no driver on this machine holds the run's lock; ``unreadable`` for a damaged file), ``iterations`` (stored iteration folders), ``checkpoints`` (complete ones, ascending),
    ``policy_version``, ``created`` (Unix seconds, or None), the newest validation as
    ``val_iteration``, ``val_metric`` and ``val_value``, and ``bytes`` (the run folder's size on disk;
    MLflow's store under the root is not counted).

    Raises:
        StoreError: ``root`` is not a folder.
    """
    root = Path(root).expanduser()
    if not root.is_dir():
        raise StoreError(f"store root {root} is not a folder (pass --store DIR)")
    rows = []
    for d in run_folders(root):
        store = RunStore(root, d.name)
        try:
            meta = store.read_run_meta()
        except (StoreError, OSError):
            meta = None
        status = str(meta.get("status", "unknown")) if isinstance(meta, dict) else "unreadable"
        if status == "running" and driver_holds_lock(store) is False:
            status = "killed"  # run.json says running, but no driver holds its lock: it died without a word
        meta = meta if isinstance(meta, dict) else {}
        val_it, val_metric, val_value = _last_validation(meta)
        created = meta.get("created")
        rows.append({
            "run_id": d.name, "kind": meta.get("kind", "train"), "parent_run_id": meta.get("parent_run_id"),
            "recipe": meta.get("recipe"), "status": status, "iterations": len(store.iterations()),
            "checkpoints": list_checkpoints(store), "policy_version": meta.get("policy_version"),
            "created": float(created) if isinstance(created, (int, float)) else None,
            "val_iteration": val_it, "val_metric": val_metric, "val_value": val_value,
            "bytes": folder_bytes(d),
        })
    rows.sort(key=lambda r: (r["created"] is None, r["created"] or 0.0, r["run_id"]))
    return rows


def format_runs(rows: list[dict[str, Any]]) -> list[list[str]]:
    """The rows as table cells: run, kind, recipe, status, iterations, checkpoints, last validation, size,
    created."""
    out = []
    for r in rows:
        kind = r["kind"] if not r["parent_run_id"] else f"{r['kind']} of {r['parent_run_id']}"
        ckpts = r["checkpoints"]
        shown = "-" if not ckpts else (", ".join(str(c) for c in ckpts) if len(ckpts) <= 3
                                       else f"{len(ckpts)} ({ckpts[0]}..{ckpts[-1]})")
        val = "-" if r["val_metric"] is None else \
            f"{r['val_value']:.3f} at {r['val_iteration']} ({r['val_metric'].split('/')[-2]})"
        created = "-" if r["created"] is None else time.strftime("%Y-%m-%d %H:%M", time.localtime(r["created"]))
        out.append([r["run_id"], kind, str(r["recipe"] or "-"), r["status"], str(r["iterations"]), shown, val,
                    format_bytes(int(r.get("bytes") or 0)), created])
    return out
