"""`trajflow gc` frees only what no resume or replay needs, lists before it deletes, and `runs`
shows each run's size: on run folders laid out as a run leaves them (no training needed)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from trajflow.prune import apply, plan
from trajflow.run.gate import _want_data_docs
from trajflow.runs import folder_bytes, format_bytes, list_runs

TRAJFLOW = [str(Path(sys.executable).parent / "trajflow")]


def _file(path: Path, n: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x" * n)
    return path


def _run(root: Path, run_id: str, checkpoints=(), meta=None, gates=None) -> Path:
    d = root / run_id
    _file(d / "config.yaml", 10)
    (d / "run.json").write_text(json.dumps({"run_id": run_id, "status": "finished", **(meta or {})}))
    for it in checkpoints:
        _file(d / "checkpoints" / f"{it:06d}" / "actor" / "model.safetensors", 1000 * it)
        (d / "checkpoints" / f"{it:06d}" / "trainer_state.json").write_text("{}")
    for it, success in (gates or {}).items():
        idir = d / "iterations" / f"{it:06d}"
        _file(idir / "data_docs" / "index.html", 500)
        (idir / "gate.json").write_text(json.dumps({"success": success}))
        (idir / "manifest.json").write_text("{}")
    return d


def test_gc_keeps_what_resume_and_replay_need(tmp_path):
    root = tmp_path / "runs"
    a = _run(root, "a", checkpoints=[2, 4, 6, 8], meta={"best_checkpoint": {"iteration": 4}},
             gates={1: True, 2: False})
    _file(a / "iterations" / "000001" / ".rollout.parquet.123.tmp", 70)
    _file(a / "checkpoints" / ".tmp-000010" / "actor" / "model.safetensors", 300)
    _run(root, "a-replay", meta={"kind": "replay", "parent_run_id": "a", "start_checkpoint": 2})
    before = folder_bytes(a)

    # by default: leftovers and the passed gate's HTML only, no checkpoint
    (p,) = [x for x in plan(root, ["a"]) if x.run_id == "a"]
    assert sorted((c.kind, c.bytes) for c in p.candidates) == [("data_docs", 500), ("leftover", 70), ("leftover", 300)]
    # --older-checkpoints: 6 only (8 newest: resume; 4 best; 2 a replay's start)
    (p,) = plan(root, ["a"], older_checkpoints=True)
    doomed = [c for c in p.candidates if c.kind == "checkpoint"]
    assert [(c.path.name, c.bytes) for c in doomed] == [("000006", 6000 + 2)]  # + trainer_state.json
    assert doomed[0].what == "checkpoint 000006 (a replay of iterations 7..8 would start from it)"
    assert p.kept == ["checkpoint 000002: a replay run in this store starts from it",
                      "checkpoint 000004: best by trainer.keep_best", "checkpoint 000008: newest: resume continues from it"]
    assert apply(root, [p]) == 500 + 70 + 300 + 6002
    assert folder_bytes(a) == before - 6872 + folder_bytes(a / ".lock.json")  # deleted under the run's lock
    left = sorted(x.name for x in (a / "checkpoints").iterdir())
    assert left == ["000002", "000004", "000008"]
    assert not (a / "iterations" / "000001" / "data_docs").exists()
    assert (a / "iterations" / "000002" / "data_docs" / "index.html").exists()  # its gate failed: kept
    assert plan(root, ["a"], older_checkpoints=True)[0].candidates == []


def test_gc_lists_without_yes_and_runs_prints_sizes(tmp_path):
    root = tmp_path / "runs"
    a = _run(root, "a", checkpoints=[1, 2], gates={1: True})
    cli = subprocess.run(TRAJFLOW + ["gc", "--store", str(root), "--older-checkpoints"], capture_output=True, text=True)
    assert cli.returncode == 0, cli.stderr
    assert "a:    1.0 kB  checkpoint 000001 (a replay of iteration 2 would start from it)" in cli.stdout
    assert f"would free 1.5 kB in {root}; nothing deleted (pass --yes to delete)" in cli.stdout
    assert (a / "checkpoints" / "000001").exists()
    cli = subprocess.run(TRAJFLOW + ["gc", "--store", str(root), "--yes"], capture_output=True, text=True)
    assert cli.returncode == 0 and f"freed 500 B in {root}" in cli.stdout, cli.stdout + cli.stderr
    assert (a / "checkpoints" / "000001").exists()  # not without --older-checkpoints
    assert list_runs(root)[0]["bytes"] == folder_bytes(a) == 10 + len((a / "run.json").read_bytes()) + 3000 + 4 + \
        len((a / "iterations" / "000001" / "gate.json").read_bytes()) + 2 + folder_bytes(a / ".lock.json")
    listing = subprocess.run(TRAJFLOW + ["runs", "--store", str(root)], capture_output=True, text=True)
    assert format_bytes(folder_bytes(a)) in listing.stdout and "1 runs, " in listing.stdout
    bad = subprocess.run(TRAJFLOW + ["gc", "nope", "--store", str(root)], capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.strip() == f"error: no run 'nope' under {root}"


def test_data_docs_are_written_when_the_gate_fails_by_default():
    from types import SimpleNamespace as NS

    warned = NS(success=True, results=[NS(status="pass"), NS(status="warn")])
    failed = NS(success=False, results=[NS(status="fail")])
    passed = NS(success=True, results=[NS(status="pass"), NS(status="skipped")])
    assert [_want_data_docs("on_failure", r) for r in (passed, warned, failed)] == [False, False, True]
    assert [_want_data_docs("on_warning", r) for r in (passed, warned, failed)] == [False, True, True]
    assert [_want_data_docs("never", r) for r in (passed, warned, failed)] == [False, False, False]
