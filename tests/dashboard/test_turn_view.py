"""The trajectory browser shows a stored multi-turn episode turn by turn, in Streamlit's AppTest,
on a real multi-turn run (tiny EOS-prone model, scripted tool calls through the real sandbox)."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tests.conftest import tiny_overrides
from tests.mt_envs import make_eos_model


@pytest.fixture(scope="module")
def mt_run(tmp_path_factory, ray_local):
    from trajflow.flows.train import train

    model = make_eos_model(tmp_path_factory.mktemp("eos-model"))
    root = tmp_path_factory.mktemp("mt-store")
    over = tiny_overrides(model, root, **{
        "data.dataset": "basic_arithmetic_tool", "rollout.max_new_tokens": 96,
        "rollout.multi_turn.enable": True, "rollout.multi_turn.environment": "tests.mt_envs:scripted_calls",
        "rollout.multi_turn.max_assistant_turns": 4, "rollout.multi_turn.max_tokens_per_turn": 24,
        "trainer.total_iterations": 1, "trainer.test_freq": 0, "trainer.log_samples": 0})
    summary = train("grpo_tool_calculator", over)
    return root, Path(summary["run_dir"]).name


def _page():
    from trajflow.dashboards.trajectories_page import trajectories_page

    trajectories_page()


def _open(mt_run, monkeypatch):
    """The run's first iteration rows, those that stopped, and the trajectories page opened on the run."""
    from streamlit.testing.v1 import AppTest

    root, run = mt_run
    rows = pq.read_table(root / run / "iterations" / "000001" / "rollout.parquet").to_pylist()
    done = [r for r in rows if r["finish_reason"] == "stop"]
    assert done, [r["finish_reason"] for r in rows]
    monkeypatch.setenv("TRAJFLOW_STORE", str(root))
    at = AppTest.from_function(_page, default_timeout=120)
    at.query_params["run"] = run
    at.run()
    return rows, done, at


def test_turn_view_shows_tool_results_and_errors(mt_run, monkeypatch):
    rows, done, at = _open(mt_run, monkeypatch)
    assert not at.exception, at.exception
    captions = [c.value for c in at.caption]
    # the script: calculator, then an unknown tool, then done
    assert captions.count("3 turns · finish stop · 2 tool calls · 1 tool errors") == len(done)
    calc = [e for e in at.expander if e.label == "tool call calculator"]
    assert len(calc) == sum(1 for r in rows for c in r["tool_calls"] if c["name"] == "calculator")
    assert calc[0].code[0].value == '{"expression": "1234 * 5678"}'
    assert calc[0].code[1].value == "7006652"
    bad = [e for e in at.expander if e.label == "tool call search · error"]
    assert bad and bad[0].error[0].value.startswith("unknown tool: 'search'")
    roles = [m.markdown[0].value for m in at.chat_message][:5]
    assert roles[:2] == ["**assistant** · turn 1", "**tool** · turn 1"]


def test_group_view_shows_multi_turn_rows_turn_by_turn(mt_run, monkeypatch):
    rows, done, at = _open(mt_run, monkeypatch)
    at.radio(key="traj_view").set_value("groups").run()
    assert not at.exception, at.exception
    captions = [c.value for c in at.caption]
    assert sum(c.startswith("2 groups") for c in captions) == 1  # 2 prompts x n=2, every row in one
    assert captions.count("3 turns · finish stop · 2 tool calls · 1 tool errors") == len(done)
    # Each response's header (``s<k> · score ...``), then its own turn caption, in sample id order.
    heads = [i for i, c in enumerate(captions) if c.split(" · ", 1)[0] in ("s0", "s1") and " · score " in c]
    assert len(heads) == len(rows), captions
    by_id = sorted(rows, key=lambda r: r["sample_id"])
    assert [captions[i + 1].split(" · ")[:2] for i in heads] == \
        [[f"{r['num_turns']} turns", f"finish {r['finish_reason']}"] for r in by_id]
    codes = [c.value for c in at.code]
    for r in done:  # not the whole text at once: the tool results are set apart from the turns
        assert r["response_text"] not in codes
        assert [m.markdown[0].value for m in at.chat_message].count("**tool** · turn 2") >= 1
    calc = [e for e in at.expander if e.label == "tool call calculator"]
    assert len(calc) == sum(1 for r in rows for c in r["tool_calls"] if c["name"] == "calculator")
    assert calc[0].code[0].value == '{"expression": "1234 * 5678"}'
    assert calc[0].code[1].value == "7006652"
    bad = [e for e in at.expander if e.label == "tool call search · error"]
    assert len(bad) == sum(1 for r in rows for c in r["tool_calls"] if c["name"] == "search")
    assert bad[0].error[0].value.startswith("unknown tool: 'search'")


def test_response_card_shows_a_multi_turn_response_once(mt_run, monkeypatch):
    rows, done, at = _open(mt_run, monkeypatch)
    assert not at.exception, at.exception
    codes = [c.value for c in at.code]
    for r in rows:  # not the flat text beside the prompt and then again turn by turn
        assert r["response_text"] not in codes
    captions = [c.value for c in at.caption]
    assert sum(c.startswith("response: ") and c.endswith(" turns, below") for c in captions) == len(rows)
    # each assistant turn's text once per response (the turn view), not twice
    assistant = [m for r in rows for m in r["messages"] if m["role"] == "assistant"]
    shown = [m for m in at.chat_message if m.markdown[0].value.startswith("**assistant**")]
    assert len(shown) == len(assistant)
