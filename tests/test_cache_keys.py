"""Stage cache keys are digests of typed settings: a new field, or a changed value, is a new key."""

import dataclasses

import pytest

from trajflow.stages.rollout import SamplingParams
from trajflow.run.cache_keys import AdvantageSettings, RewardSettings, RolloutSettings, digest, stage_key

SETTINGS = [
    RolloutSettings(sampling=SamplingParams(n=4, temperature=0.7, seed=3), filter_groups={"enable": False},
                    adv_estimator="grpo", rollout={"engine": "hf", "dtype": "float32"}, model_path="/m",
                    model={"lora_rank": 0}),
    RewardSettings(reward={"default_scorer": "gsm8k"}, custom_function_sha256=None, max_new_tokens=32,
                   temperature=1.0, use_kl_in_reward=False, kl_penalty="kl", kl_coef=None, reference=False,
                   reference_path=None, teacher_path=None),
    AdvantageSettings(algorithm={"adv_estimator": "grpo", "gamma": 1.0}, trainer_version=None),
]


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: type(s).__name__)
def test_a_field_added_to_a_stages_settings_changes_its_key(settings):
    cls = type(settings)
    # A test double of the settings with one more field (at its default): what a developer adding a
    # setting to the stage writes. Nothing else changes, and the key does.
    extended = dataclasses.make_dataclass(cls.__name__, [("new_setting", int, dataclasses.field(default=0))],
                                          bases=(cls,), frozen=True)
    grown = extended(**{f.name: getattr(settings, f.name) for f in dataclasses.fields(cls)})
    assert stage_key(grown, rollout="ab") != stage_key(settings, rollout="ab")
    assert stage_key(settings, rollout="ab") == stage_key(cls(**dataclasses.asdict(settings)), rollout="ab")


def _changed(value):
    if isinstance(value, SamplingParams):
        return dataclasses.replace(value, seed=value.seed + 1)
    if isinstance(value, dict):
        return {**value, "x": 1}
    if isinstance(value, bool):
        return not value
    if value is None or isinstance(value, str):
        return "other"
    return value + 1


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: type(s).__name__)
def test_every_field_of_a_stages_settings_is_in_its_key(settings):
    key = stage_key(settings)
    for f in dataclasses.fields(settings):
        other = _changed(getattr(settings, f.name))
        assert stage_key(dataclasses.replace(settings, **{f.name: other})) != key, f.name


def test_the_key_keeps_the_upstream_digests_and_names_the_settings_class():
    key = stage_key(SETTINGS[2], rollout="r1", reward="w1")
    assert key["rollout"] == "r1" and key["reward"] == "w1"
    same_fields = dataclasses.make_dataclass("Other", [("algorithm", dict), ("trainer_version", int)], frozen=True)
    assert stage_key(same_fields(SETTINGS[2].algorithm, None))["settings"] != key["settings"]
    assert len(digest({"a": 1})) == 16
