"""mean@n, maj@n and best@n of validation, against values worked out by hand."""

import numpy as np
import pytest

from trajflow.metrics import validation_metrics

SRC = "reasoning_gym/basic_arithmetic"


def _row(extracted, acc):
    return {"extracted": extracted, "acc": acc}


def test_majority_best_and_mean_of_four_samples_per_prompt():
    # prompt 1: "12" x2 (right), "13" x1, none x1 -> vote "12" -> 1; best 1; accs 1,1,0,0
    # prompt 2: "7" x1 (right), "8" x2 (wrong), "9" -> vote "8" -> 0; best 1; accs 1,0,0,0
    # prompt 3: "5" (wrong) then "4" (right), one each, two without an answer -> tie, first stated wins -> 0
    # prompt 4: no answer at all -> vote 0; best 0
    extras = [_row("12", 1.0), _row("13", 0.0), _row(None, 0.0), _row(" 12 ", 1.0),
              _row("7", 1.0), _row("8", 0.0), _row("8", 0.0), _row("9", 0.0),
              _row("5", 0.0), _row(None, 0.0), _row("4", 1.0), _row("", 0.0),
              _row(None, 0.0), _row(None, 0.0), _row(None, 0.0), _row(None, 0.0)]
    acc = np.array([e["acc"] for e in extras])
    scores = acc + 0.1
    m = validation_metrics([SRC] * 16, scores, extras, [[1, 2]] * 16, n=4)
    assert m[f"val-core/{SRC}/acc/mean_at_4"] == pytest.approx(4 / 16)
    assert m[f"val-core/{SRC}/acc/maj_at_4/mean"] == pytest.approx(1 / 4)
    assert m[f"val-core/{SRC}/acc/best_at_4/mean"] == pytest.approx(3 / 4)
    assert m[f"val-aux/{SRC}/reward/mean_at_4"] == pytest.approx(4 / 16 + 0.1)
    assert m["val-aux/response_length/mean"] == 2.0
    # Unbiased pass@k (Chen et al. 2021, Eq. 1), correct counts c = 2, 1, 1, 0 of n = 4:
    # k=2: 1 - C(4-c,2)/6 = 5/6, 1/2, 1/2, 0; k=3: 1, 3/4, 3/4, 0; k=4: 1, 1, 1, 0
    assert m[f"val-core/{SRC}/acc/pass_at_1/mean"] == pytest.approx(1 / 4)
    assert m[f"val-core/{SRC}/acc/pass_at_2/mean"] == pytest.approx((5 / 6 + 1 / 2 + 1 / 2) / 4)
    assert m[f"val-core/{SRC}/acc/pass_at_3/mean"] == pytest.approx((1 + 3 / 4 + 3 / 4) / 4)
    assert m[f"val-core/{SRC}/acc/pass_at_4/mean"] == pytest.approx(3 / 4)
    assert m[f"val-core/{SRC}/acc/best_at_2/mean"] == pytest.approx(11 / 24)  # 0/1 accuracies: pass@2
    # maj@2 over the 6 pairs of each prompt (ties to the first stated): 4/6, 3/6, 2/6, 0
    assert m[f"val-core/{SRC}/acc/maj_at_2/mean"] == pytest.approx((4 + 3 + 2) / 6 / 4)
    assert f"val-core/{SRC}/acc/best_at_3/mean" not in m  # verl's k: 2, 4


def test_one_sample_has_no_vote_and_sources_are_kept_apart():
    extras = [_row("1", 1.0), _row("2", 0.0)]
    m = validation_metrics(["a", "b"], np.array([1.0, 0.0]), extras, [[1], [1, 2, 3]], n=1)
    assert m == {"val-core/a/acc/mean_at_1": 1.0, "val-aux/a/reward/mean_at_1": 1.0,
                 "val-core/b/acc/mean_at_1": 0.0, "val-aux/b/reward/mean_at_1": 0.0,
                 "val-aux/response_length/mean": 2.0}


def test_two_sources_vote_per_prompt():
    extras = [_row("3", 1.0), _row("3", 1.0), _row("x", 0.0), _row("y", 1.0)]
    m = validation_metrics(["a", "a", "b", "b"], np.ones(4), extras, [[1]] * 4, n=2)
    assert m["val-core/a/acc/maj_at_2/mean"] == 1.0
    assert m["val-core/b/acc/maj_at_2/mean"] == 0.0  # tie "x"/"y": "x" was stated first
    assert m["val-core/b/acc/best_at_2/mean"] == 1.0


def test_rows_not_a_multiple_of_n_name_the_key():
    with pytest.raises(ValueError, match="rollout.val_n=4"):
        validation_metrics([SRC] * 6, np.zeros(6), [{}] * 6, [[1]] * 6, n=4)


def test_no_vote_for_a_scorer_that_states_no_answer():
    """An environment's reward (the env scorer) extracts no answer: maj@n is left out, best@n stays."""
    extras = [{"acc": 1.0}, {"acc": 0.0}, {"acc": 0.0}, {"acc": 0.0}]
    m = validation_metrics(["env"] * 4, np.array([1.0, 0.0, 0.0, 0.0]), extras, [[1]] * 4, n=2)
    assert "val-core/env/acc/maj_at_2/mean" not in m
    assert m["val-core/env/acc/best_at_2/mean"] == 0.5 and m["val-core/env/acc/mean_at_2"] == 0.25


def _batch(prompts, responses, finish):
    import pyarrow as pa

    return pa.table({"prompt_ids": pa.array(prompts, pa.list_(pa.int32())),
                     "response_ids": pa.array(responses, pa.list_(pa.int32())),
                     "finish_reason": finish, "score": [1.0] * len(finish)})


def test_mean_terminated_length_and_timing_per_token_by_hand():
    from trajflow.metrics import batch_metrics, timing_per_token_metrics

    # responses of 3, 5 (truncated), 2 tokens; prompts of 4, 4, 6 tokens
    t = _batch([[1] * 4, [1] * 4, [1] * 6], [[2] * 3, [2] * 5, [2] * 2], ["stop", "length", "stop"])
    m = batch_metrics(t)
    assert m["response_length/mean"] == pytest.approx(10 / 3)
    assert m["response_length/mean_terminated"] == pytest.approx((3 + 2) / 2)  # the truncated 5 left out
    # verl's compute_timing_metrics: gen per response token (10), the others per prompt + response token (24)
    tm = timing_per_token_metrics({"timing_s/gen": 2.0, "timing_s/update_actor": 4.8, "timing_s/adv": 0.024,
                                   "timing_s/reward": 9.0, "actor/pg_loss": 1.0}, t)
    assert tm == {"timing_per_token_ms/gen": pytest.approx(2000 / 10),
                  "timing_per_token_ms/update_actor": pytest.approx(4800 / 24),
                  "timing_per_token_ms/adv": pytest.approx(24 / 24)}
    only_cut = batch_metrics(_batch([[1]], [[2, 2]], ["length"]))
    assert "response_length/mean_terminated" not in only_cut
