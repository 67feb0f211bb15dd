"""Freeing disk space in a store root safely (``trajflow gc``), and what each run takes on disk.

What may go, by default:

- leftovers of killed writers: hidden temp files (``.<name>.*.tmp``), ``.final-tmp``, hidden
  checkpoint folders (``.tmp-*``, ``.del-*``; an ``.old-*`` checkpoint that was being swapped
  out is put back, as a resume would, not deleted);
- Great Expectations' HTML data docs of iterations whose gate passed (``gate.json`` keeps the
  results; the HTML is a rendering of them).

With ``older_checkpoints``: complete checkpoints that no resume needs, i.e. all but the newest,
the best (``run.json``'s ``best_checkpoint``) and any a replay run in the store starts from
(its ``start_checkpoint``). Each one is named with the replays it would take away (a replay of
iteration N starts from checkpoint N-1).

Never touched: the newest checkpoint (what ``resume`` continues from), stage outputs and manifests
(what ``replay`` and ``audit`` read), ``final/``, ``run.json``, ``config.yaml``, logs, and MLflow's
store. A run whose lock is held (a driver is using it) is skipped. Deleting a checkpoint renames it
to a hidden name first, so a crash mid-deletion leaves no half-deleted folder that looks complete.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from trajflow import checkpoint as ckpt
from trajflow.errors import StoreError
from trajflow.runs import driver_holds_lock, folder_bytes, format_bytes
from trajflow.store import RunStore, run_folders

__all__ = ["Candidate", "RunPrune", "apply", "format_bytes", "plan"]


@dataclass
class Candidate:
    """One thing ``gc`` would delete: ``path``, its ``bytes``, ``what`` it is (one line) and ``kind``
    (``leftover``, ``data_docs``, ``checkpoint``)."""

    path: Path
    bytes: int
    what: str
    kind: str


@dataclass
class RunPrune:
    """A run's plan: its ``run_id``, ``bytes`` on disk, the ``candidates``, and ``skipped`` (why the
    run is left alone, e.g. in use) or ``kept`` (checkpoints kept and why)."""

    run_id: str
    bytes: int
    candidates: list[Candidate] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    skipped: str | None = None


def _replay_starts(root: Path) -> dict[str, set[int]]:
    """Checkpoints of each run that a replay run in the store starts from (``run.json``'s
    ``parent_run_id`` + ``start_checkpoint``)."""
    out: dict[str, set[int]] = {}
    for d in run_folders(root):
        try:
            meta = json.loads((d / "run.json").read_text())
        except (OSError, ValueError):
            continue
        start = meta.get("start_checkpoint") if isinstance(meta, dict) else None
        if isinstance(start, int) and meta.get("parent_run_id"):
            out.setdefault(str(meta["parent_run_id"]), set()).add(start)
    return out


def _leftovers(store: RunStore) -> list[Candidate]:
    out = []
    for d in [store.run_dir] + [store.iteration_dir(i) for i in store.iterations()]:
        if d.exists():
            out += [Candidate(p, p.stat().st_size, "temp file of a killed writer", "leftover")
                    for p in sorted(d.iterdir()) if p.name.startswith(".") and p.name.endswith(".tmp") and p.is_file()]
    tmp = store.run_dir / ".final-tmp"
    if tmp.exists():
        out.append(Candidate(tmp, folder_bytes(tmp), "final model of a killed export", "leftover"))
    cdir = store.checkpoints_dir()
    if cdir.exists():
        for p in sorted(cdir.iterdir()):
            if p.is_dir() and p.name.startswith((".tmp-", ".del-")):
                out.append(Candidate(p, folder_bytes(p), "checkpoint of a killed writer", "leftover"))
    return out


def _data_docs(store: RunStore) -> list[Candidate]:
    out = []
    for it in store.iterations():
        docs = store.iteration_dir(it) / "data_docs"
        if not docs.is_dir():
            continue
        try:
            passed = bool(json.loads((store.iteration_dir(it) / "gate.json").read_text()).get("success"))
        except (OSError, ValueError, AttributeError):
            passed = False  # no readable result beside it: the HTML is all there is
        if passed:
            out.append(Candidate(docs, folder_bytes(docs), f"gate data docs of iteration {it} (gate passed; "
                                 f"gate.json keeps the results)", "data_docs"))
    return out


def _checkpoints(store: RunStore, replay_starts: set[int]) -> tuple[list[Candidate], list[str]]:
    done = ckpt.list_checkpoints(store)
    if not done:
        return [], []
    best = (store.read_run_meta().get("best_checkpoint") or {}).get("iteration")
    kept = {done[-1]: "newest: resume continues from it"}
    if isinstance(best, int) and best in done:
        kept.setdefault(best, "best by trainer.keep_best")
    for it in sorted(replay_starts & set(done)):
        kept.setdefault(it, "a replay run in this store starts from it")
    out = []
    for it in done:
        if it in kept:
            continue
        later = [c for c in done if c > it]
        upto = later[0] if later else None
        span = f"iteration {it + 1}" if upto == it + 1 else f"iterations {it + 1}..{upto}"
        out.append(Candidate(ckpt.checkpoint_dir(store, it), folder_bytes(ckpt.checkpoint_dir(store, it)),
                             f"checkpoint {it:06d} (a replay of {span} would start from it)", "checkpoint"))
    return out, [f"checkpoint {it:06d}: {why}" for it, why in sorted(kept.items())]


def plan(root: str | Path, run_ids: list[str] | None = None, older_checkpoints: bool = False) -> list[RunPrune]:
    """What ``gc`` would delete in each run (nothing is deleted).

    Args:
        root: the store root.
        run_ids: only these runs (default: every run folder).
        older_checkpoints: also offer the checkpoints no resume needs.

    Returns:
        One :class:`RunPrune` per run, in the store's order.

    Raises:
        StoreError: ``root`` is not a folder, or a named run does not exist.
    """
    root = Path(root).expanduser()
    if not root.is_dir():
        raise StoreError(f"store root {root} is not a folder (pass --store DIR)")
    folders = run_folders(root)
    if run_ids:
        names = {d.name for d in folders}
        missing = [r for r in run_ids if r not in names]
        if missing:
            raise StoreError(f"no run {missing[0]!r} under {root}")
        folders = [d for d in folders if d.name in set(run_ids)]
    starts = _replay_starts(root) if older_checkpoints else {}
    out = []
    for d in folders:
        store = RunStore(root, d.name)
        entry = RunPrune(d.name, folder_bytes(d))
        if driver_holds_lock(store):
            entry.skipped = "in use (a driver holds its lock)"
        else:
            entry.candidates = _leftovers(store) + _data_docs(store)
            if older_checkpoints:
                more, entry.kept = _checkpoints(store, starts.get(d.name, set()))
                entry.candidates += more
        out.append(entry)
    return out


def apply(root: str | Path, plans: list[RunPrune]) -> int:
    """Delete what ``plans`` list, each run under its lock (a run a driver took meanwhile is skipped).

    Returns:
        The bytes freed.
    """
    from trajflow.store import run_lock

    freed = 0
    for entry in plans:
        if entry.skipped or not entry.candidates:
            continue
        store = RunStore(root, entry.run_id)
        try:
            with run_lock(store):
                for c in entry.candidates:
                    if c.kind == "leftover":
                        continue  # below, with the writers' own cleanup (it puts a swapped-out checkpoint back)
                    trash = c.path.with_name(f".del-{c.path.name}") if c.kind == "checkpoint" else c.path
                    if trash != c.path:
                        os.replace(c.path, trash)  # atomic: the checkpoint is either complete or gone
                    shutil.rmtree(trash, ignore_errors=True)
                    freed += c.bytes
                if any(c.kind == "leftover" for c in entry.candidates):
                    freed += sum(c.bytes for c in entry.candidates if c.kind == "leftover")
                    store.cleanup_temp()
                    ckpt.cleanup(store)
        except StoreError:
            entry.skipped = "in use (a driver took its lock)"
    return freed
