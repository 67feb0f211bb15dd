"""A multi-turn run through the real train flow (Prefect, Ray, MLflow on SQLite): episodes with tool calls
in the sandbox, stored with the row contract, counted in the metrics, and filterable in the audit."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tests.conftest import tiny_overrides
from tests.mt_envs import make_eos_model

pytestmark = pytest.mark.usefixtures("ray_local")


@pytest.fixture(scope="module")
def eos_model(tmp_path_factory) -> Path:
    return make_eos_model(tmp_path_factory.mktemp("eos-model"))


def test_multi_turn_train_run_stores_episodes_and_audits_tools(eos_model, tmp_path):
    from trajflow.flows.train import train
    from trajflow.audit import query_audit

    over = tiny_overrides(eos_model, tmp_path / "runs", **{
        "data.dataset": "basic_arithmetic_tool", "rollout.max_new_tokens": 96,
        "rollout.multi_turn.enable": True, "rollout.multi_turn.environment": "tests.mt_envs:scripted_calls",
        "rollout.multi_turn.max_assistant_turns": 4, "rollout.multi_turn.max_tokens_per_turn": 24,
        "trainer.test_freq": 2, "trainer.log_samples": 0})
    from trajflow.envs.sandbox import Sandbox

    probe = Sandbox([], allow_weaker=True)
    probe.probe_isolation()
    weaker = bool(probe.missing)  # where the kernel refuses a namespace, the run must be allowed a weaker sandbox
    over.append(f"rollout.multi_turn.allow_weaker_sandbox={str(weaker).lower()}")
    summary = train("grpo_tool_calculator", over)
    run_dir = Path(summary["run_dir"])
    # What the tool sandbox isolated on this machine is part of the run's record.
    import json

    sandbox = json.loads((run_dir / "run.json").read_text())["tool_sandbox"]
    assert sandbox == {"isolation": probe.isolation, "missing": probe.missing, "allow_weaker": weaker}
    # Validation ran as episodes too (2 held-out prompts, greedy): its lengths count the tool turns' tokens.
    assert summary["metrics"]["val-aux/response_length/mean"] > 0
    t = pq.read_table(run_dir / "iterations" / "000001" / "rollout.parquet").to_pylist()
    assert len(t) == 4  # 2 prompts x n=2
    stopped = 0
    for row in t:
        n = len(row["response_ids"])
        assert len(row["loss_mask"]) == len(row["rollout_logprobs"]) == n <= 96
        spans = row["turn_spans"]
        assert len(spans) == 2 * row["num_turns"] and spans[0] == 0
        generated = sum(b - a for a, b in zip(spans[::2], spans[1::2]))
        assert sum(row["loss_mask"]) == generated
        assert all(lp == 0.0 for lp, m in zip(row["rollout_logprobs"], row["loss_mask"]) if m == 0)
        assert row["finish_reason"] in ("stop", "length", "max_turns")
        if row["finish_reason"] == "stop":  # the script: calculator, unknown tool, done
            stopped += 1
            assert row["num_turns"] == 3
            assert [(c["turn"], c["name"], c["result"], c["error"] is None) for c in row["tool_calls"]] == [
                (0, "calculator", "7006652", True), (1, "search", row["tool_calls"][1]["result"], False)]
            assert row["tool_calls"][1]["error"].startswith("unknown tool: 'search'")
            assert [m["role"] for m in row["messages"]] == ["assistant", "tool", "assistant", "tool", "assistant"]
            assert row["messages"][1]["content"] == "7006652"
    assert stopped >= 1, [r["finish_reason"] for r in t]

    last = pq.read_table(run_dir / "iterations" / "000002" / "rollout.parquet").to_pylist()
    m = summary["metrics"]
    assert m["tool/calls"] == sum(len(r["tool_calls"]) for r in last)
    assert m["tool/errors"] == sum(c["error"] is not None for r in last for c in r["tool_calls"])
    assert m["num_turns/max"] == max(r["num_turns"] for r in last)

    found = query_audit(tmp_path / "runs", summary["run_id"],
                        where="tool_errors > 0 AND tool_names LIKE '%,search,%' AND iteration = 1")
    assert found.num_rows == sum(any(c["error"] for c in r["tool_calls"]) for r in t) >= 1
    assert set(found.column("tool_names").to_pylist()) == {",calculator,search,"}
    none = query_audit(tmp_path / "runs", summary["run_id"], where="tool_names LIKE '%,python,%'")
    assert none.num_rows == 0
