"""Registry metadata: what each advantage estimator needs besides rewards."""

from __future__ import annotations

import dataclasses

import pytest

from trajflow.stages.advantage import ADV_ESTIMATORS, EstimatorMeta, needs_greedy_baseline, needs_groups, needs_values
from trajflow.stages.registry import Registry


def test_estimator_metadata():
    assert needs_values("gae") and not needs_greedy_baseline("gae")
    assert needs_greedy_baseline("remax") and not needs_values("remax")
    for name in ("grpo", "rloo"):
        assert not needs_values(name) and not needs_greedy_baseline(name)
        assert ADV_ESTIMATORS.meta(name) == EstimatorMeta(needs_groups=True)  # a group baseline
    assert ADV_ESTIMATORS.meta("gae") == EstimatorMeta(needs_values=True)
    groups = {n for n in ADV_ESTIMATORS.names() if needs_groups(n)}
    assert groups == {"grpo", "rloo", "reinforce_plus_plus_baseline", "opo", "gpg", "grpo_passk"}


@pytest.mark.parametrize("lookup", [ADV_ESTIMATORS.meta, needs_values, needs_greedy_baseline])
def test_unknown_estimator_names_the_registered_ones(lookup):
    with pytest.raises(ValueError) as err:
        lookup("grpoo")
    msg = str(err.value)
    assert "advantage estimator 'grpoo'" in msg and "Did you mean 'grpo'?" in msg
    assert str(ADV_ESTIMATORS.names()) in msg


def test_metadata_defaults_and_unknown_fields():
    @dataclasses.dataclass(frozen=True)
    class Meta:
        fast: bool = False

    reg = Registry("thing", meta=Meta)

    @reg.register("a", fast=True)
    @reg.register("b")
    def fn():
        return 1

    assert reg.meta("a") == Meta(fast=True) and reg.meta("b") == Meta()
    with pytest.raises(dataclasses.FrozenInstanceError):
        reg.meta("a").fast = False  # type: ignore[misc]
    with pytest.raises(ValueError, match=r"thing 'c': unknown metadata slow; allowed: fast"):
        reg.register("c", slow=True)
    with pytest.raises(ValueError, match=r"policy loss 'x': unknown metadata fast; allowed: none"):
        Registry("policy loss").register("x", fast=True)
