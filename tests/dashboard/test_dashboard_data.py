"""The dashboard's data layer and the run's MLflow artifacts, checked against the stored files.

Expected values come from reading the run's Parquet/JSON files (or MLflow) directly here.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

TRAJFLOW = str(Path(sys.executable).parent / "trajflow")


def stored_rows(run_dir: Path) -> list[dict]:
    """All responses of a run: rollout + reward + advantage rows joined by sample_id, by hand."""
    rows = []
    for d in sorted((run_dir / "iterations").iterdir()):
        ro = pq.read_table(d / "rollout.parquet").to_pylist()
        rw = {r["sample_id"]: r for r in pq.read_table(d / "reward.parquet").to_pylist()}
        ad = {r["sample_id"]: r for r in pq.read_table(d / "advantage.parquet").to_pylist()}
        rows += [dict(r, score=rw[r["sample_id"]]["score"], advantages=ad[r["sample_id"]]["advantages"]) for r in ro]
    return rows


def test_find_trajectories_filters_and_columns(two_runs):
    from trajflow.dashboards.data import TRAJECTORY_COLUMNS, TrajectoryFilter, find_trajectories, trajectory_facets

    run = two_runs.names[0]
    rows = stored_rows(two_runs.root / run)
    assert len(rows) == 12

    everything = find_trajectories(two_runs.root, run, limit=1000)
    assert tuple(everything.column_names) == TRAJECTORY_COLUMNS
    assert sorted(everything.column("sample_id").to_pylist()) == sorted(r["sample_id"] for r in rows)
    by_id = {r["sample_id"]: r for r in everything.to_pylist()}
    for r in rows:
        got = by_id[r["sample_id"]]
        assert got["response_text"] == r["response_text"]
        assert got["response_length"] == len(r["response_ids"])
        assert got["advantage_mean"] == pytest.approx(float(np.mean(r["advantages"])), rel=1e-6, abs=1e-7)
        assert got["score"] == pytest.approx(r["score"], rel=1e-6)
        assert got["policy_version"] == r["policy_version"]
        assert got["iteration"] == r["iteration"]

    later = find_trajectories(two_runs.root, run, TrajectoryFilter(iterations=(2, 3)), limit=1000)
    assert sorted(later.column("sample_id").to_pylist()) == sorted(r["sample_id"] for r in rows if r["iteration"] >= 2)

    scores = sorted(r["score"] for r in rows)
    lo, hi = scores[3], scores[8]  # an inner range, both ends inclusive
    ranged = find_trajectories(two_runs.root, run, TrajectoryFilter(score_range=(lo, hi)), limit=1000)
    assert ranged.num_rows == sum(lo <= s <= hi for s in scores)

    length = find_trajectories(two_runs.root, run, TrajectoryFilter(finish_reasons=("length",)), limit=1000)
    assert length.num_rows == sum(r["finish_reason"] == "length" for r in rows)
    assert find_trajectories(two_runs.root, run, TrajectoryFilter(data_sources=("nope",))).num_rows == 0
    assert find_trajectories(two_runs.root, run, limit=5).num_rows == 5

    # a long word (no stop word: the audit table's full-text index drops those) of some response
    common = {"between", "because", "through", "against", "yourself", "themselves", "ourselves", "yourselves"}
    hit_row, word = next((r, w) for r in rows for w in re.findall(r"[A-Za-z]{7,}", r["response_text"] or "")
                         if w.lower() not in common)
    hits = find_trajectories(two_runs.root, run, TrajectoryFilter(search=word), limit=1000)
    assert hit_row["sample_id"] in hits.column("sample_id").to_pylist()
    assert all(word.lower()[:5] in (h["response_text"] + h["prompt_text"]).lower() for h in hits.to_pylist())

    facets = trajectory_facets(two_runs.root, run)
    assert facets["iterations"] == [1, 2, 3]
    assert facets["data_sources"] == ["reasoning_gym/basic_arithmetic"]
    assert facets["score_min"] == pytest.approx(scores[0]) and facets["score_max"] == pytest.approx(scores[-1])


def test_where_clause_for_the_audit_table():
    from trajflow.dashboards.data import TrajectoryFilter, where_clause

    assert where_clause(TrajectoryFilter()) is None
    assert where_clause(TrajectoryFilter(iterations=(2, 5), data_sources=("gsm8k", "o'neil"), score_range=(0.0, 1.0),
                                         finish_reasons=("stop",))) == (
        "iteration >= 2 AND iteration <= 5 AND data_source IN ('gsm8k', 'o''neil') AND score >= 0.0 AND "
        "score <= 1.0 AND finish_reason IN ('stop')")


def test_gate_reports_match_gate_json(two_runs):
    from trajflow.errors import DashboardError
    from trajflow.dashboards.data import gate_reports

    run = two_runs.names[1]
    reports = gate_reports(two_runs.root, run)
    assert [r["iteration"] for r in reports] == [1, 2, 3]
    for r in reports:
        stored = json.loads((two_runs.root / run / "iterations" / f"{r['iteration']:06d}" / "gate.json").read_text())
        assert r["success"] == stored["success"]
        assert r["quarantined"] == len(stored["quarantined_sample_ids"])
        names = {k.split("/")[1] for k in stored["metrics"] if k.startswith("gate/") and k.count("/") == 2}
        assert {g["gate"] for g in r["gates"]} == names
        for g in r["gates"]:
            assert g["success"] == bool(stored["metrics"][f"gate/{g['gate']}/success"])
    with pytest.raises(DashboardError, match="no-such-run"):
        gate_reports(two_runs.root, "no-such-run")


def test_run_logs_config_and_end_of_run_plots(two_runs, tmp_path):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(two_runs.tracking_uri)
    for name in two_runs.names:
        rid = two_runs.mlflow_ids[name]
        top = {a.path for a in client.list_artifacts(rid)}
        assert {"config.yaml", "plots", "samples", "gates"} <= top
        assert {a.path for a in client.list_artifacts(rid, "plots")} == {"plots/reward.png", "plots/response_length.png"}
        cfg = Path(client.download_artifacts(rid, "config.yaml", str(tmp_path)))
        assert cfg.read_text() == (two_runs.root / name / "config.yaml").read_text()
        png = Path(client.download_artifacts(rid, "plots/reward.png", str(tmp_path)))
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        kept = two_runs.root / name / "plots"  # the learning curve stays in the run folder too
        assert sorted(p.name for p in kept.iterdir()) == ["response_length.png", "reward.png"]
        assert (kept / "reward.png").read_bytes() == png.read_bytes()
        tags = client.get_run(rid).data.tags
        assert tags["trajflow.run_id"] == name and tags["trajflow.recipe"] == "grpo_default"


def test_dashboard_cli_rejects_missing_store(tmp_path):
    p = subprocess.run([TRAJFLOW, "dashboard", "--store", str(tmp_path / "nope")], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and "nope" in p.stderr and "does not exist" in p.stderr


def test_lineage_tags():
    from trajflow.tracking import lineage_tags

    assert lineage_tags("grpo-1", 7, "reward") == {"trajflow.parent_run_id": "grpo-1",
                                                   "trajflow.parent_iteration": "7", "trajflow.from_stage": "reward"}


def _by_hand_prompt_text(prompt: list | str) -> str:
    """Stored chat messages (a list column; JSON text in runs stored before) as ``role: content`` lines."""
    msgs = json.loads(prompt) if isinstance(prompt, str) else prompt
    return "\n".join(f"{m['role']}: {m['content']}" for m in msgs)


def test_substring_search_and_sorting_agree_with_and_without_the_audit_table(two_runs, tmp_path):
    import shutil

    from trajflow.dashboards.data import TrajectoryFilter, find_trajectories, trajectory_source

    run = two_runs.names[0]
    rows = stored_rows(two_runs.root / run)
    # A fragment from inside a word, in the wrong case: whole-word full-text search cannot find it.
    word = next(w for r in rows for w in re.findall(r"[A-Za-z]{6,}", r["response_text"] or ""))
    frag = word[1:5].upper()
    expected = sorted(r["sample_id"] for r in rows
                      if frag.lower() in (r["response_text"] or "").lower()
                      or frag.lower() in _by_hand_prompt_text(r["prompt"]).lower())
    assert expected
    top = sorted(rows, key=lambda r: (-r["score"], r["iteration"], r["sample_id"]))[:4]

    def query() -> tuple[list, list]:
        hits = find_trajectories(two_runs.root, run, TrajectoryFilter(search=frag), limit=1000)
        best = find_trajectories(two_runs.root, run, TrajectoryFilter(sort_by="score", descending=True), limit=4)
        return sorted(hits.column("sample_id").to_pylist()), best.column("sample_id").to_pylist()

    assert trajectory_source(two_runs.root, run) == "audit"
    with_audit = query()
    audit_dir = two_runs.root / run / "audit.lance"
    shutil.move(audit_dir, tmp_path / "audit.lance")
    try:
        assert trajectory_source(two_runs.root, run) == "parquet"
        without_audit = query()
    finally:
        shutil.move(tmp_path / "audit.lance", audit_dir)
    assert with_audit[0] == without_audit[0] == expected
    assert with_audit[1] == without_audit[1] == [r["sample_id"] for r in top]


def test_group_view_holds_each_prompt_once_with_all_its_responses(two_runs):
    from trajflow.dashboards.data import TrajectoryFilter, find_groups

    run = two_runs.names[0]
    rows = stored_rows(two_runs.root / run)
    by_group: dict = {}
    for r in rows:
        by_group.setdefault((r["iteration"], r["group_id"]), []).append(r)
    # The group of the best-scoring response comes first; every group holds all its n = 2 responses.
    best = max(rows, key=lambda r: (r["score"], -r["iteration"]))
    groups = find_groups(two_runs.root, run, TrajectoryFilter(sort_by="score", descending=True), limit=100)
    assert (groups[0]["iteration"], groups[0]["group_id"]) == (best["iteration"], best["group_id"])
    assert sorted((g["iteration"], g["group_id"]) for g in groups) == sorted(by_group)
    for g in groups:
        stored = sorted(by_group[(g["iteration"], g["group_id"])], key=lambda r: r["sample_id"])
        assert [r["sample_id"] for r in g["rows"]] == [r["sample_id"] for r in stored] and len(stored) == 2
        assert g["prompt_text"] == _by_hand_prompt_text(stored[0]["prompt"])
        scores = [r["score"] for r in stored]
        assert g["score_mean"] == pytest.approx((scores[0] + scores[1]) / 2, rel=1e-6)
        assert g["score_std"] == pytest.approx(abs(scores[0] - scores[1]) / 2, rel=1e-5, abs=1e-7)
        for got, want in zip(g["rows"], stored):
            assert got["advantage_mean"] == pytest.approx(float(np.mean(want["advantages"])), rel=1e-6, abs=1e-7)
    assert len(find_groups(two_runs.root, run, TrajectoryFilter(iterations=(2, 2)), limit=1)) == 1


def test_gate_reports_carry_each_expectations_threshold_and_status(two_runs):
    from trajflow.dashboards.data import gate_reports

    run = two_runs.names[0]
    reports = gate_reports(two_runs.root, run)
    assert [r["iteration"] for r in reports] == [1, 2, 3]
    for r in reports:
        stored = json.loads((two_runs.root / run / "iterations" / f"{r['iteration']:06d}" / "gate.json").read_text())
        by = {g["gate"]: g for g in r["gates"]}
        # the tiny runs use the config's gate defaults and rollout.max_new_tokens=8
        assert by["score_in_range"]["expected"] == "in [-10, 10] (gates.score_min, gates.score_max)"
        assert by["response_length_max"]["expected"] == "in [0, 8] (rollout.max_new_tokens)"
        assert by["truncated_frac"]["policy"] == "warn"
        truncated = stored["metrics"]["gate/truncated_frac/observed"]
        assert by["truncated_frac"]["status"] == ("pass" if truncated <= 0.5 else "warn")
        assert by["truncated_frac"]["observed"] == pytest.approx(truncated)
        assert r["success"] == all(g["status"] != "FAIL" for g in r["gates"])


def test_browser_tests_skip_with_the_install_command_when_chromium_is_missing(tmp_path):
    """On a machine without Chromium (and no root to install it) the README's test command still passes."""
    env = dict(__import__("os").environ, TRAJFLOW_TEST_CHROMIUM=str(tmp_path / "no-chromium"))
    browser_tests = str(Path(__file__).with_name("test_dashboard_browser.py"))
    listed = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider",
                             browser_tests], capture_output=True, text=True, env=env,
                            cwd=Path(__file__).parents[2], timeout=300)
    n = sum("::" in line for line in listed.stdout.splitlines())
    assert n >= 4, listed.stdout[-2000:]
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", browser_tests],
                         capture_output=True, text=True, env=env, cwd=Path(__file__).parents[2], timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    # Every browser test skips (none runs without the browser, none fails), each naming the install command.
    assert re.search(rf"\b{n} skipped\b", out.stdout) and "apt-get install -y chromium" in out.stdout, out.stdout
