"""The dashboard's per-token view, per-iteration histograms, all-equal group share and prompt history,
checked against stored files read here by hand and against a small run folder written here with
values chosen so the expected numbers are known without the code under test."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest


def _write_run(root: Path, run: str, iterations: dict[int, list[dict]]) -> Path:
    """A run folder with rollout + reward Parquet files: ``{iteration: [{"group", "prompt", "score", "len"}]}``."""
    d = root / run
    (d / "iterations").mkdir(parents=True)
    (d / "config.yaml").write_text("model:\n  path: nowhere\n")
    for it, rows in iterations.items():
        idir = d / "iterations" / f"{it:06d}"
        idir.mkdir()
        ids = [f"it{it}-{r['group']}-s{k}" for k, r in enumerate(rows)]
        pq.write_table(pa.table({
            "sample_id": ids, "iteration": [it] * len(rows), "group_id": [f"it{it}-{r['group']}" for r in rows],
            "prompt_id": [r["prompt"] for r in rows], "data_source": ["src"] * len(rows),
            "prompt": [[{"role": "user", "content": f"question {r['prompt']}"}] for r in rows],
            "response_text": [f"answer {k}" for k in range(len(rows))], "ground_truth": ["1"] * len(rows),
            "finish_reason": ["stop"] * len(rows),
            "response_ids": pa.array([list(range(r["len"])) for r in rows], pa.list_(pa.int32())),
            "policy_version": [it - 1] * len(rows)}), idir / "rollout.parquet")
        pq.write_table(pa.table({"sample_id": ids, "score": pa.array([r["score"] for r in rows], pa.float32()),
                                 "reward_extra": [None] * len(rows), "reward_error": [None] * len(rows)}),
                       idir / "reward.parquet")
    return d


ITERATIONS = {
    # iteration 1: group a all 1.0 (equal), group b mixed, group c a single response (equal): 2 of 3
    1: [dict(group="a", prompt="p1", score=1.0, len=3), dict(group="a", prompt="p1", score=1.0, len=5),
        dict(group="b", prompt="p2", score=0.0, len=4), dict(group="b", prompt="p2", score=1.0, len=4),
        dict(group="c", prompt="p3", score=0.5, len=7)],
    # iteration 2: p1 again, now mixed; group d all 0.0: 1 of 2
    2: [dict(group="a", prompt="p1", score=0.0, len=2), dict(group="a", prompt="p1", score=1.0, len=6),
        dict(group="d", prompt="p4", score=0.0, len=1), dict(group="d", prompt="p4", score=0.0, len=9)],
}


def test_all_equal_share_histograms_and_prompt_history_by_hand(tmp_path):
    from trajflow.dashboards.iteration_stats import (all_equal_group_share, iteration_distributions, prompt_history,
                                            repeated_prompts)

    _write_run(tmp_path, "r", ITERATIONS)
    assert all_equal_group_share(tmp_path, "r") == {1: pytest.approx(2 / 3), 2: pytest.approx(1 / 2)}

    dist = iteration_distributions(tmp_path, "r").to_pylist()
    assert dist == [{"iteration": it, "score": r["score"], "response_length": r["len"]}
                    for it, rows in ITERATIONS.items() for r in rows]

    assert repeated_prompts(tmp_path, "r") == [("p1", 2)]
    hist = prompt_history(tmp_path, "r", "p1")
    assert [(g["iteration"], g["group_id"]) for g in hist] == [(1, "it1-a"), (2, "it2-a")]
    assert [g["score_mean"] for g in hist] == [1.0, 0.5]
    assert [g["score_std"] for g in hist] == [0.0, 0.5]  # population std of (0, 1)
    assert [[r["response_length"] for r in g["rows"]] for g in hist] == [[3, 5], [2, 6]]
    assert all(g["prompt_text"] == "user: question p1" for g in hist)
    assert prompt_history(tmp_path, "r", "nope") == []


def _stored(run_dir: Path, it: int) -> dict[str, dict]:
    d = run_dir / "iterations" / f"{it:06d}"
    rows = {r["sample_id"]: r for r in pq.read_table(d / "rollout.parquet").to_pylist()}
    for stage in ("reward", "advantage"):
        for r in pq.read_table(d / f"{stage}.parquet").to_pylist():
            rows[r["sample_id"]].update(r)
    return rows


def test_token_view_matches_the_stored_columns(two_runs):
    from transformers import AutoTokenizer

    from trajflow.dashboards.tokens import run_tokenizer, token_html, token_rows

    run = two_runs.names[0]
    run_dir = two_runs.root / run
    rows = _stored(run_dir, 2)
    gate = json.loads((run_dir / "iterations" / "000002" / "gate.json").read_text())
    model_dir = re.search(r"^  path: (.+)$", (run_dir / "config.yaml").read_text(), re.M).group(1).strip("'\"")
    tok = AutoTokenizer.from_pretrained(model_dir)
    assert run_tokenizer(two_runs.root, run) is not None
    sid, row = max(rows.items(), key=lambda kv: len(kv[1]["response_ids"]))
    view = token_rows(two_runs.root, run, 2, sid, run_tokenizer(two_runs.root, run))
    n = len(row["response_ids"])
    assert len(view["tokens"]) == n > 0
    assert {"rollout_logprobs", "advantages", "token_rewards"} <= set(view["columns"])
    masked = sid in gate.get("quarantined_sample_ids", [])
    for i, t in enumerate(view["tokens"]):
        assert t["token_id"] == row["response_ids"][i]
        assert t["text"] == tok.decode([row["response_ids"][i]])
        assert t["rollout_logprobs"] == pytest.approx(row["rollout_logprobs"][i], abs=0)
        assert t["advantages"] == pytest.approx(row["advantages"][i], abs=0)
        assert t["token_rewards"] == pytest.approx(row["token_rewards"][i], abs=0)
        assert t["loss_mask"] == (0 if masked else 1)
    assert view["quarantined"] == masked

    html = token_html(view, "advantages")
    spans = re.findall(r'<span class="tf-token" data-index="(\d+)" data-loss-mask="(\d)" ([^>]*)>', html)
    assert [int(s[0]) for s in spans] == list(range(n))
    for (_, _, attrs), t in zip(spans, view["tokens"]):
        adv = float(re.search(r'data-advantages="([^"]+)"', attrs).group(1))
        assert adv == t["advantages"]
        bg = re.search(r"background:([^;]+);", attrs).group(1)
        assert bg.startswith("rgba(0,160,60" if adv > 0 else "rgba(220,40,40" if adv < 0 else "rgba(128,128,128")
    # colour by log-prob: a token the policy found certain (p = 1) is faintest, an unlikely one reddest
    by_lp = token_html(view, "rollout_logprobs")
    alphas = [float(a) for a in re.findall(r"background:rgba\(220,40,40,([0-9.]+)\)", by_lp)]
    lps = [t["rollout_logprobs"] for t in view["tokens"]]
    assert len(alphas) == n
    for a, lp in zip(alphas, lps):
        assert a == pytest.approx(0.05 + 0.7 * (1 - math.exp(lp)), abs=1e-3)


def test_token_view_without_tokenizer_and_a_bad_sample(two_runs, tmp_path):
    from trajflow.dashboards.tokens import token_html, token_rows
    from trajflow.errors import DashboardError

    run = two_runs.names[0]
    rows = _stored(two_runs.root / run, 1)
    sid, row = next(iter(rows.items()))
    view = token_rows(two_runs.root, run, 1, sid, tokenizer=None)
    assert [t["text"] for t in view["tokens"]] == [f"<{i}>" for i in row["response_ids"]]
    with pytest.raises(DashboardError, match="no response 'nope'"):
        token_rows(two_runs.root, run, 1, "nope")
    with pytest.raises(DashboardError, match="color_by='score'"):
        token_html(view, "score")


def test_list_runs_says_which_runs_finished_an_iteration(two_runs):
    from mlflow.tracking import MlflowClient

    from trajflow.dashboards.data import has_iterations, list_runs

    rows = {r["run"]: r for r in list_runs(MlflowClient(two_runs.tracking_uri))}
    for name in two_runs.names:
        assert rows[name]["iterations_done"] is True
        assert has_iterations(two_runs.root, name)
        assert rows[name]["prefect_flow_run_id"]  # trained inside a Prefect flow run
    assert not has_iterations(two_runs.root, "no-such-run")
    assert not has_iterations(two_runs.root / "lr-high" / "iterations", "..")  # a name that leaves the store
