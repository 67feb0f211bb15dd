"""rollout.multi_turn config: the recipe loads, and bad combinations are one-line errors naming the key."""

from __future__ import annotations

import pytest

from trajflow.config import load_config
from trajflow.errors import ConfigError


def test_recipe_loads_and_points_at_smollm2():
    cfg = load_config("grpo_tool_calculator")
    mt = cfg.rollout.multi_turn
    assert cfg.model.path == "smollm2-135m-instruct" and cfg.data.dataset == "basic_arithmetic_tool"
    assert (mt.enable, mt.environment, mt.format) == (True, "tool_calculator", "hermes")
    assert load_config("grpo").rollout.multi_turn.enable is False  # off unless asked for


@pytest.mark.parametrize("overrides, message", [
    (["rollout.multi_turn.environment=tool_calculater"],  # other test modules may register more names
     "rollout.multi_turn.environment='tool_calculater' is not registered: choose one of "),
    (["rollout.multi_turn.environment=tool_calculater"], "(did you mean 'tool_calculator'?)"),
    (["rollout.multi_turn.environment=tests.sandbox_tools:nothing"],
     "rollout.multi_turn.environment='tests.sandbox_tools:nothing': cannot import"),
    (["algorithm.adv_estimator=remax"], "does not support algorithm.adv_estimator='remax'"),
    (["algorithm.filter_groups.enable=true"], "does not support algorithm.filter_groups.enable=true"),
    (["model.prompt_format=plain"], "needs model.prompt_format='auto'"),
    (["actor.strategy=deepspeed", "actor.zero_stage=3", "actor.world_size=2", "data.train_batch_size=8"],
     "does not support actor.zero_stage=3 with actor.world_size=2 on the hf engine"),
    (["rollout.multi_turn.format=json"], "rollout.multi_turn.format='json' is not allowed"),
    (["rollout.multi_turn.max_assistant_turns=0"], "rollout.multi_turn.max_assistant_turns=0 is out of range"),
])
def test_bad_multi_turn_config(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config("grpo_tool_calculator", overrides)
    assert message in str(e.value)


def test_tool_config_is_checked_with_the_config(tmp_path):
    p = tmp_path / "tools.yaml"
    p.write_text("tools:\n  - name: calculator\n    bogus: 1\n")
    with pytest.raises(ConfigError) as e:
        load_config("grpo_tool_calculator", [f"rollout.multi_turn.tool_config_path={p}"])
    assert f"rollout.multi_turn.tool_config_path={str(p)!r}: tools[0] (calculator): unknown field 'bogus'" in str(e.value)
