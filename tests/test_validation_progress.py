"""Validation generates its held-out prompts data.val_batch_size at a time and the console's live line
counts them (item: evaluate was silent for ~70 s); chunk 0 is seeded as a one-call validation was."""

import io

from trajflow.run.validation import ValidationProgress, generate_in_chunks
from trajflow.stages.seeds import Salt, iteration_seed


def _fake_generate(calls):
    """A stand-in for the policy worker's generate (plain Python: the loop is what is under test)."""
    def generate(part, seed):
        calls.append((list(part), seed))
        return [[p, seed] for p in part], [f"r{p}" for p in part], None
    return generate


def test_chunks_in_order_with_their_own_seeds_and_the_line_advancing():
    calls, done = [], []
    ids, texts, eps = generate_in_chunks([0, 1, 2, 3, 4], 2, 42, 3, _fake_generate(calls), done.append)
    assert [c[0] for c in calls] == [[0, 1], [2, 3], [4]]
    assert [c[1] for c in calls] == [iteration_seed(42, 3, Salt.VALIDATION), iteration_seed(42, 3, 1001),
                                     iteration_seed(42, 3, 1002)]
    assert len({c[1] for c in calls}) == 3
    assert done == [2, 2, 1]
    assert texts == ["r0", "r1", "r2", "r3", "r4"] and [i[0] for i in ids] == [0, 1, 2, 3, 4] and eps is None


def test_one_chunk_is_the_old_single_call():
    calls = []
    generate_in_chunks([0, 1, 2], 0, 7, 0, _fake_generate(calls), lambda k: None)
    generate_in_chunks([0, 1, 2], 64, 7, 0, _fake_generate(calls), lambda k: None)
    assert calls == [([0, 1, 2], iteration_seed(7, 0, Salt.VALIDATION))] * 2


def test_the_live_line_shows_prompts_done(monkeypatch):
    import sys

    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    with ValidationProgress(5, 4, True) as bar:
        bar.update(2)
        bar.update(2)
    out = err.getvalue()
    assert "validate step 5" in out and "2/4" in out and "4/4" in out
    err.truncate(0)
    with ValidationProgress(5, 4, False) as bar:  # trainer.progress=false: nothing
        bar.update(4)
    assert err.getvalue() == ""
