"""DAPO dynamic-sampling group filter, checked by hand."""

from __future__ import annotations

import numpy as np
import pytest

from trajflow.stages.dynamic_sampling import groups_with_signal, take_first_groups


def test_groups_with_signal_keeps_groups_with_distinct_values():
    # group a: 1, 0 (signal); b: 1, 1 (all correct); c: 0, 0, 0 (all wrong); d: one row; e: 0.5, 0.25
    gids = ["a", "a", "b", "b", "c", "c", "c", "d", "e", "e"]
    metric = [1, 0, 1, 1, 0, 0, 0, 1, 0.5, 0.25]
    keep = groups_with_signal(metric, gids)
    assert keep.tolist() == [True, True, False, False, False, False, False, False, True, True]


def test_groups_need_not_be_contiguous():
    assert groups_with_signal([1.0, 0.0, 0.0, 0.0], [7, 8, 7, 8]).tolist() == [True, False, True, False]


def test_groups_with_signal_errors():
    with pytest.raises(ValueError, match="one value per row"):
        groups_with_signal([1.0, 0.0], ["a"])
    with pytest.raises(ValueError, match="row 1 is not finite"):
        groups_with_signal([1.0, float("nan")], ["a", "a"])


def test_take_first_groups_cuts_the_surplus_in_order():
    gids = ["a", "a", "b", "b", "c", "c", "d", "d"]
    keep = np.array([True, True, False, False, True, True, True, True])
    assert take_first_groups(gids, keep, 2).tolist() == [True, True, False, False, True, True, False, False]
    assert take_first_groups(gids, keep, 10).tolist() == keep.tolist()
    assert not take_first_groups(gids, keep, 0).any()
    with pytest.raises(ValueError, match="max_groups"):
        take_first_groups(gids, keep, -1)
