"""``rollout.agent`` is code: named on the command line (or a config the user passes) it is checked at
validation in one line; named only by a stored run folder it is refused, never imported."""

from __future__ import annotations

import pytest
import yaml

from tests.test_crash_safety import _fake_iteration
from trajflow.config import load_config, to_yaml
from trajflow.errors import ConfigError
from trajflow.store import RunStore

PLANT = "import pathlib\npathlib.Path({marker!r}).write_text('agent ran')\ndef run(task, url, key):\n    return 1.0\n"


def test_agent_spec_errors_are_one_line():
    with pytest.raises(ConfigError, match=r"rollout\.agent='nope': expected 'module:function'"):
        load_config(None, ["rollout.agent=nope"])
    with pytest.raises(ConfigError, match=r"rollout\.agent='no_such_module_xyz:run': cannot import"):
        load_config(None, ["rollout.agent=no_such_module_xyz:run"])
    with pytest.raises(ConfigError, match=r"has no function 'missing'"):
        load_config(None, ["rollout.agent=examples.agents.calculator_agent:missing"])
    with pytest.raises(ConfigError, match=r"rollout\.agent does not support algorithm\.adv_estimator='remax'"):
        load_config(None, ["rollout.agent=examples.agents.calculator_agent:agent", "algorithm.adv_estimator=remax"])
    cfg = load_config("grpo_tool_calculator", ["rollout.agent=examples.agents.calculator_agent:agent"])
    assert cfg.rollout.agent == "examples.agents.calculator_agent:agent"


def test_a_stored_agent_is_not_imported_unless_named_again(tmp_path, monkeypatch):
    from trajflow.run import resume_config

    marker = tmp_path / "MARKER"
    (tmp_path / "evil_agent.py").write_text(PLANT.format(marker=str(marker)))
    monkeypatch.syspath_prepend(str(tmp_path))
    store = RunStore(tmp_path / "runs", "r1")
    store.run_dir.mkdir(parents=True)
    cfg = yaml.safe_load(to_yaml(load_config(None, [f"store.root={store.root}"])))
    cfg["rollout"]["agent"] = "evil_agent:run"
    store.write_config(yaml.safe_dump(cfg))
    store.update_run_meta(run_id="r1", status="failed")
    _fake_iteration(store, 1, [0.0, 1.0, 0.5, 0.5], ["a", "b", "c", "d"])
    store.mark(1, "complete")
    root = str(store.root)
    with pytest.raises(ConfigError, match=r"names rollout\.agent='evil_agent:run'; code named by a run folder is not "
                                          r"imported.*pass rollout\.agent=evil_agent:run again"):
        resume_config("r1", [f"store.root={root}"])
    assert not marker.exists()
    kept = resume_config("r1", [f"store.root={root}", "rollout.agent=examples.agents.calculator_agent:agent"])
    assert kept.rollout.agent == "examples.agents.calculator_agent:agent" and not marker.exists()


def test_the_example_agent_feeds_the_built_in_environments_prompt(tiny_model_dir):
    """The example agent's first request renders to exactly the prompt ids of the built-in
    tool_calculator environment (same instructions, worked episode and tools block), so the two can be
    compared as rollouts of one task."""
    from transformers import AutoTokenizer

    from examples.agents import calculator_agent as ex
    from trajflow.envs.base import EnvContext
    from trajflow.envs.render import ChatRenderer
    from trajflow.envs.tool_calculator import ToolCalculatorEnv
    from trajflow.envs.tools import BUILTIN_TOOLS
    from trajflow.serve.chat import template_messages

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    row = {"messages": [{"role": "system", "content": "Think briefly."},
                        {"role": "user", "content": "Calculate 1234 + 5678 - 90 + 12."}]}
    env = ToolCalculatorEnv(EnvContext([], None))
    builtin = ChatRenderer(tok, [BUILTIN_TOOLS["calculator"].schema()], [tok.eos_token_id]).prompt_ids(env.reset(row))
    messages = list(row["messages"])
    messages[0] = {"role": "system", "content": messages[0]["content"] + "\n\n" + ex.SYSTEM}
    messages[1:1] = ex.EXAMPLE
    served = ChatRenderer(tok, ex.TOOLS, [tok.eos_token_id]).prompt_ids(template_messages(messages))
    assert served == builtin
    assert ex.calculate("4021 - 387 + 1290 - 56") == "4868" and ex.calculate("__import__('os')").startswith("Error")
