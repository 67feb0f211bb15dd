"""Tests for trajflow.gates: real Great Expectations 1.x, no mocks.

GX is imported once per process (trajflow.gates keeps one ephemeral context), so the first test
pays the ~5 s import and the rest take milliseconds each. Expected values are written by hand from
the views built here (counts of bad rows, fractions such as 3/10), never copied from the gate.
"""

from __future__ import annotations

import json

import pyarrow as pa
import pytest

from trajflow import gates
from trajflow.config import GatesConfig
from trajflow.errors import GateFailed

NAN, INF = float("nan"), float("inf")


MAX_NEW_TOKENS = 32  # rollout.max_new_tokens of the views below


def settings(**overrides):
    """The config's gates section with the limits these tests use."""
    base = dict(enabled=True, suite=None, score_min=0.0, score_max=1.0,
                max_equal_group_frac=0.95, max_truncated_frac=0.5, max_error_rate=0.1,
                drift_band=0.2, drift_window=5, policies={})
    base.update(overrides)
    return GatesConfig(**base)


def run_gate(view, s, *, history=(), max_new_tokens=MAX_NEW_TOKENS):
    """``gates.run_gate`` with the rollout's ``max_new_tokens``."""
    return gates.run_gate(view, s, max_new_tokens, history=history)


def make_view(scores, *, group_size=2, lengths=None, finish=None, errors=None, iteration=7):
    """A gate view: sample ids s0..s{n-1}, groups of ``group_size`` consecutive rows."""
    n = len(scores)
    return pa.table({
        "sample_id": pa.array([f"s{i}" for i in range(n)], pa.string()),
        "group_id": pa.array([f"g{i // group_size}" for i in range(n)], pa.string()),
        "iteration": pa.array([iteration] * n, pa.int64()),
        "score": pa.array(scores, pa.float32()),
        "response_length": pa.array(lengths if lengths is not None else [10] * n, pa.int32()),
        "finish_reason": pa.array(finish if finish is not None else ["stop"] * n, pa.string()),
        "reward_error": pa.array(errors if errors is not None else [None] * n, pa.string()),
    })


# ten rows in five groups of two; no two scores in a group are equal; mean 0.5
GOOD_SCORES = [0.0, 1.0, 0.25, 0.75, 0.5, 0.625, 0.375, 0.5, 1.0, 0.0]
DEFAULT_NAMES = ["score_not_null", "score_finite", "score_in_range", "response_length_max",
                 "equal_reward_group_frac", "truncated_frac", "scorer_error_rate", "score_mean_drift"]


def test_all_good_view_passes_every_expectation():
    report = run_gate(make_view(GOOD_SCORES), settings(), history=[0.5, 0.5])
    assert report.success
    assert [r.name for r in report.results] == DEFAULT_NAMES
    assert all(r.success for r in report.results), [r for r in report.results if not r.success]
    assert report.quarantined_sample_ids == set()
    assert report.failure_message() == ""
    assert report.iteration == 7 and report.rows == 10
    assert report.score_mean == pytest.approx(0.5)
    assert report.outcome("score_mean_drift").observed_value == pytest.approx(0.0)
    assert report.outcome("equal_reward_group_frac").observed_value == 0.0
    # GX's own result is there and is strict JSON
    assert report.gx_result_json["samples"]["success"] is True
    json.dumps(report.gx_result_json, allow_nan=False)


def test_drift_is_skipped_without_history():
    report = run_gate(make_view(GOOD_SCORES), settings())
    drift = report.outcome("score_mean_drift")
    assert drift.success and drift.observed_value is None
    assert "no score history" in drift.details["skipped"]
    assert report.metrics()["gate/score_mean_drift/skipped"] == 1.0


def test_nan_scores_fail_under_fail_policy():
    scores = list(GOOD_SCORES)
    scores[3] = scores[8] = NAN
    report = run_gate(make_view(scores), settings())
    assert not report.success
    for name in ("score_not_null", "score_finite"):
        outcome = report.outcome(name)
        assert not outcome.success
        assert outcome.observed_value == 2 and outcome.unexpected_count == 2
        assert set(outcome.details["sample_ids"]) == {"s3", "s8"}
    assert report.outcome("score_in_range").success  # NaN is left to the null/finite checks
    msg = report.failure_message()
    lines = msg.splitlines()
    assert len(lines) == 2
    assert any("score_finite" in line and "observed 2" in line and "rows 2" in line
               for line in lines)
    assert report.quarantined_sample_ids == set()
    with pytest.raises(GateFailed, match="score_not_null"):
        report.raise_for_failure()
    assert report.metrics()["gate/success"] == 0.0
    assert report.metrics()["gate/score_finite/observed"] == 2.0


def test_nan_scores_quarantined_under_quarantine_policy():
    scores = list(GOOD_SCORES)
    scores[3] = scores[8] = NAN
    pol = {"score_not_null": "quarantine", "score_finite": "quarantine"}
    report = run_gate(make_view(scores), settings(policies=pol))
    assert report.success
    assert report.quarantined_sample_ids == {"s3", "s8"}
    assert report.quarantined_reason == {"score_not_null": ["s3", "s8"],
                                         "score_finite": ["s3", "s8"]}
    assert report.metrics()["gate/quarantined_rows"] == 2.0
    kept = gates.apply_quarantine(make_view(scores), report)
    assert kept["sample_id"].to_pylist() == [f"s{i}" for i in range(10) if i not in (3, 8)]


def test_infinite_and_out_of_range_scores():
    scores = list(GOOD_SCORES)
    scores[0], scores[1], scores[2] = 1.5, -0.5, INF
    report = run_gate(make_view(scores), settings())
    in_range = report.outcome("score_in_range")
    assert not in_range.success and in_range.unexpected_count == 3
    assert set(in_range.details["sample_ids"]) == {"s0", "s1", "s2"}
    finite = report.outcome("score_finite")
    assert not finite.success and finite.details["sample_ids"] == ["s2"]
    assert report.outcome("score_not_null").success
    assert not report.success


def test_score_bounds_compare_at_float32_precision():
    # float32(1.1) is 1.10000002 in float64; a scorer returning 1.1 must pass score_max=1.1
    report = run_gate(make_view([1.1, 0.0]), settings(score_max=1.1))
    assert report.outcome("score_in_range").success


def test_constant_scores_make_every_group_equal():
    view = make_view([0.5] * 10)
    report = run_gate(view, settings(max_equal_group_frac=0.5))
    outcome = report.outcome("equal_reward_group_frac")
    assert not outcome.success
    assert outcome.observed_value == 1.0
    assert outcome.unexpected_count == 10 and outcome.policy == "warn"
    assert report.success  # warn records only
    assert report.metrics()["gate/warnings"] == 1.0

    quarantine = run_gate(view, settings(
        max_equal_group_frac=0.5, policies={"equal_reward_group_frac": "quarantine"}))
    assert quarantine.success
    assert quarantine.quarantined_sample_ids == {f"s{i}" for i in range(10)}


def test_equal_groups_quarantine_whole_groups_only():
    # groups g0..g4; g1 (s2, s3) and g3 (s6, s7) have equal scores -> 2/5 = 0.4
    scores = [0.0, 1.0, 0.5, 0.5, 0.25, 0.75, 1.0, 1.0, 0.0, 0.5]
    report = run_gate(make_view(scores), settings(
        max_equal_group_frac=0.3, policies={"equal_reward_group_frac": "quarantine"}))
    outcome = report.outcome("equal_reward_group_frac")
    assert outcome.observed_value == pytest.approx(0.4)
    assert report.quarantined_sample_ids == {"s2", "s3", "s6", "s7"}
    assert report.quarantined_reason["equal_reward_group_frac"] == ["s2", "s3", "s6", "s7"]


def test_scorer_errors_error_rate():
    errors = [None] * 10
    scores = list(GOOD_SCORES)
    for i in (1, 4, 6):
        errors[i] = "TimeoutError: math-verify took > 5 s"
        scores[i] = NAN  # the scorer raised: no score; the score checks skip these rows
    view = make_view(scores, errors=errors)
    report = run_gate(view, settings(max_error_rate=0.2))
    outcome = report.outcome("scorer_error_rate")
    assert not outcome.success
    assert outcome.observed_value == pytest.approx(0.3)
    assert outcome.unexpected_count == 3
    assert report.outcome("score_not_null").success
    assert report.outcome("score_finite").success
    assert not report.success
    line = report.failure_message()
    assert "scorer_error_rate" in line and "observed 0.3" in line and "rows 3" in line

    quarantine = run_gate(view, settings(max_error_rate=0.2,
                                         policies={"scorer_error_rate": "quarantine"}))
    assert quarantine.success
    assert quarantine.quarantined_sample_ids == {"s1", "s4", "s6"}

    passing = run_gate(view, settings(max_error_rate=0.3))
    assert passing.outcome("scorer_error_rate").success  # 0.3 <= 0.3


def test_response_longer_than_max_new_tokens():
    lengths = [10] * 10
    lengths[5] = 33
    lengths[9] = 32  # exactly the cap is fine
    report = run_gate(make_view(GOOD_SCORES, lengths=lengths), settings(), max_new_tokens=32)
    outcome = report.outcome("response_length_max")
    assert not outcome.success
    assert outcome.unexpected_count == 1 and outcome.details["sample_ids"] == ["s5"]
    assert not report.success


def test_max_new_tokens_comes_from_the_argument():
    s = settings()
    lengths = [10] * 9 + [20]
    report = gates.run_gate(make_view(GOOD_SCORES, lengths=lengths), s, max_new_tokens=16)
    assert report.outcome("response_length_max").unexpected_count == 1
    with pytest.raises(ValueError, match="max_new_tokens"):
        gates.run_gate(make_view(GOOD_SCORES), s)


def test_truncated_fraction():
    finish = ["length"] * 4 + ["stop"] * 6
    report = run_gate(make_view(GOOD_SCORES, finish=finish), settings(max_truncated_frac=0.3))
    outcome = report.outcome("truncated_frac")
    assert not outcome.success and outcome.observed_value == pytest.approx(0.4)
    assert outcome.unexpected_count == 4
    assert report.success  # default policy warn


def test_drift_against_history():
    scores = [0.8, 1.0] * 5  # mean 0.9
    view = make_view(scores)
    report = run_gate(view, settings(drift_band=0.2), history=[0.5, 0.5])
    drift = report.outcome("score_mean_drift")
    assert not drift.success
    assert drift.observed_value == pytest.approx(0.4, abs=1e-6)
    assert report.success  # default policy warn
    failing = run_gate(view, settings(drift_band=0.2, policies={"score_mean_drift": "fail"}),
                       history=[0.5, 0.5])
    assert not failing.success and "score_mean_drift" in failing.failure_message()
    # only the last drift_window entries count: mean(0.8, 0.9) = 0.85 -> drift 0.05
    windowed = run_gate(view, settings(drift_band=0.2, drift_window=2),
                        history=[0.0, 0.8, 0.9])
    assert windowed.outcome("score_mean_drift").success
    assert windowed.outcome("score_mean_drift").observed_value == pytest.approx(0.05, abs=1e-6)


def test_warn_policy_records_but_passes():
    scores = list(GOOD_SCORES)
    scores[0] = NAN
    report = run_gate(make_view(scores), settings(
        policies={"score_not_null": "warn", "score_finite": "warn"}))
    assert report.success
    assert not report.outcome("score_not_null").success
    assert report.outcome("score_not_null").policy == "warn"
    assert report.quarantined_sample_ids == set()
    assert report.failure_message() == ""
    assert report.metrics()["gate/warnings"] == 2.0


def test_thousand_row_view_completes():
    n = 1000
    scores = [((i * 37) % 101) / 100 for i in range(n)]
    scores[17] = NAN
    view = make_view(scores, group_size=8)
    report = run_gate(view, settings(policies={"score_not_null": "quarantine",
                                               "score_finite": "quarantine"}),
                      history=[0.5] * 5)
    assert report.rows == 1000
    assert report.quarantined_sample_ids == {"s17"}
    assert report.success


def test_metrics_and_json():
    report = run_gate(make_view(GOOD_SCORES), settings(), history=[0.4])
    m = report.metrics()
    assert m["gate/success"] == 1.0 and m["gate/rows"] == 10.0 and m["gate/quarantined_rows"] == 0.0
    for name in DEFAULT_NAMES:
        assert m[f"gate/{name}/success"] == 1.0
    assert m["gate/score_mean_drift/observed"] == pytest.approx(0.1)
    assert all(isinstance(v, float) for v in m.values())
    doc = gates.report_to_json(report)
    text = json.dumps(doc, allow_nan=False)
    assert json.loads(text)["results"][0]["name"] == "score_not_null"


def test_report_json_is_strict_with_infinite_values():
    scores = list(GOOD_SCORES)
    scores[0] = INF
    doc = gates.report_to_json(run_gate(make_view(scores), settings()))
    json.dumps(doc, allow_nan=False)


def test_write_data_docs(tmp_path):
    scores = list(GOOD_SCORES)
    scores[2] = NAN
    report = run_gate(make_view(scores), settings(), history=[0.5])
    index = gates.write_data_docs(report, tmp_path / "docs")
    assert index.name == "index.html" and index.is_file()
    pages = [p for p in (tmp_path / "docs" / "validations").rglob("*.html")]
    assert len(pages) == 2  # the samples and the summary validation
    html = "\n".join(p.read_text() for p in pages)
    assert "score_is_finite" in html and "scorer_error_rate" in html


def test_disabled_gate_does_nothing():
    report = run_gate(make_view([NAN] * 4), settings(enabled=False))
    assert report.success and report.results == [] and report.quarantined_sample_ids == set()


def test_settings_from_the_config_section():
    from omegaconf import OmegaConf

    cfg = OmegaConf.structured(GatesConfig)
    report = gates.run_gate(make_view(GOOD_SCORES), cfg, max_new_tokens=32)
    assert report.success
    assert {r.policy for r in report.results} == {"fail", "warn"}


def test_default_policies():
    report = run_gate(make_view(GOOD_SCORES), settings())
    assert {r.name: r.policy for r in report.results} == {
        "score_not_null": "fail", "score_finite": "fail", "score_in_range": "fail",
        "response_length_max": "fail", "equal_reward_group_frac": "warn",
        "truncated_frac": "warn", "scorer_error_rate": "fail", "score_mean_drift": "warn"}


@pytest.mark.parametrize("overrides, match", [
    (dict(policies={"score_finite": "drop"}), r"gates\.policies\.score_finite='drop'"),
    (dict(policies={"score_finit": "warn"}), r"did you mean 'score_finite'"),
    (dict(policies={"score_mean_drift": "quarantine"}), r"score_mean_drift=quarantine is not"),
    (dict(max_error_rate=1.5), r"gates\.max_error_rate=1\.5"),
    (dict(score_min=2.0), r"gates\.score_min=2\.0 must be <="),
    (dict(drift_window=0), r"gates\.drift_window=0"),
    (dict(suite="no/such/suite.json"), r"gates\.suite='no/such/suite\.json'"),
])
def test_bad_settings_name_the_key(overrides, match):
    with pytest.raises(ValueError, match=match):
        run_gate(make_view(GOOD_SCORES), settings(**overrides))


def test_bad_views_are_rejected():
    view = make_view(GOOD_SCORES)
    with pytest.raises(ValueError, match="missing column 'reward_error'"):
        run_gate(view.drop_columns(["reward_error"]), settings())
    dup = pa.concat_tables([view, view])
    with pytest.raises(ValueError, match="'sample_id' is not unique"):
        run_gate(dup, settings())
    bad_type = view.set_column(3, "score", pa.array([str(x) for x in GOOD_SCORES]))
    with pytest.raises(ValueError, match="column 'score' has type string, expected floating"):
        run_gate(bad_type, settings())


def test_a_copied_suite_with_an_added_expectation(tmp_path):
    """The docs/gates.md example: copy the default suite and add a regex check."""
    suite = json.loads(gates.DEFAULT_SUITE.read_text())
    suite["expectations"].append({
        "type": "expect_column_values_to_match_regex",
        "kwargs": {"column": "finish_reason", "regex": "^(?:stop|length)$"},
        "meta": {"name": "finish_reason_known", "policy": "quarantine"},
    })
    path = tmp_path / "my_suite.json"
    path.write_text(json.dumps(suite))
    finish = ["stop"] * 8 + ["abort", "length"]
    report = run_gate(make_view(GOOD_SCORES, finish=finish), settings(suite=str(path)))
    outcome = report.outcome("finish_reason_known")
    assert not outcome.success and outcome.unexpected_count == 1
    assert report.quarantined_reason == {"finish_reason_known": ["s8"]}
    assert report.success


def test_invalid_expectation_in_suite_file(tmp_path):
    suite = json.loads(gates.DEFAULT_SUITE.read_text())
    suite["expectations"].append({"type": "expect_column_values_to_be_between",
                                  "kwargs": {"column": "score", "min_vlue": 0}})
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(suite))
    with pytest.raises(ValueError, match=r"expectations\[8\] \(expect_column_values_to_be_between\)"):
        run_gate(make_view(GOOD_SCORES), settings(suite=str(path)))


def test_expectation_that_raises_in_gx(tmp_path):
    """A column the view lacks: GX reports an exception; warn records it, quarantine fails."""
    suite = json.loads(gates.DEFAULT_SUITE.read_text())
    suite["expectations"].append({"type": "expect_column_values_to_not_be_null",
                                  "kwargs": {"column": "data_source"},
                                  "meta": {"name": "data_source_set", "policy": "warn"}})
    path = tmp_path / "s.json"
    path.write_text(json.dumps(suite))
    report = run_gate(make_view(GOOD_SCORES), settings(suite=str(path)))
    outcome = report.outcome("data_source_set")
    assert not outcome.success and "data_source" in outcome.details["exception"]
    assert report.success
    strict = run_gate(make_view(GOOD_SCORES), settings(
        suite=str(path), policies={"data_source_set": "quarantine"}))
    assert not strict.success and "GX raised" in strict.failure_message()


def test_settings_as_a_plain_dict():
    report = gates.run_gate(make_view(GOOD_SCORES), {"score_max": 0.5}, max_new_tokens=32)
    assert report.outcome("score_in_range").unexpected_count == 4  # 1.0, 0.75, 0.625, 1.0


def test_each_expectation_says_what_it_expects_and_how_its_failure_counts():
    finish = ["length"] * 4 + ["stop"] * 6  # truncated fraction 0.4 > 0.3: a warning
    scores = list(GOOD_SCORES)
    scores[3] = 2.5  # out of [0, 1]: blocking
    scores[5] = NAN  # quarantined under its policy
    report = run_gate(make_view(scores, finish=finish),
                      settings(max_truncated_frac=0.3, policies={"score_not_null": "quarantine"}))
    by = {o.name: o for o in report.results}
    assert {n: o.status for n, o in by.items()} == {
        "score_not_null": "quarantined", "score_finite": "FAIL", "score_in_range": "FAIL",
        "response_length_max": "pass", "equal_reward_group_frac": "pass", "truncated_frac": "warn",
        "scorer_error_rate": "pass", "score_mean_drift": "skipped"}
    assert by["score_in_range"].details["threshold"] == "in [0, 1] (gates.score_min, gates.score_max)"
    assert by["response_length_max"].details["threshold"] == "in [0, 32] (rollout.max_new_tokens)"
    assert by["truncated_frac"].details["threshold"] == "<= 0.3 (gates.max_truncated_frac)"
    assert by["score_not_null"].details["threshold"] == "not null"
    assert by["score_finite"].details["threshold"] == "in {True}"
    assert by["truncated_frac"].line() == "truncated_frac: warn (policy warn, expected <= 0.3 " \
        "(gates.max_truncated_frac), observed 0.4, rows 4)"
    assert "expected in [0, 1] (gates.score_min, gates.score_max)" in report.failure_message()
    j = by["score_in_range"].to_json()
    assert (j["status"], j["policy"], j["unexpected_count"], j["sample_ids"]) == ("FAIL", "fail", 1, ["s3"])


def test_a_missing_suite_lists_each_place_looked_in_once(monkeypatch):
    from trajflow.gates.suite import SUITE_DIR, _resolve_suite_path

    monkeypatch.chdir(SUITE_DIR.parents[1])  # the repository root: cwd and the root are one candidate
    with pytest.raises(ValueError) as e:
        _resolve_suite_path("no_such_suite.json")
    looked = str(e.value).split("(looked in ", 1)[1].rstrip(")").split(", ")
    assert len(looked) == len(set(looked)) == 2, str(e.value)
