"""Partial rollouts (``trainer.partial_rollout``): config refusals, the pool's budgets and rules by hand,
per-token behaviour log-probs of a row resumed under new weights against teacher-forced forwards,
the schedule's per-token versions by hand, and exact resume after SIGKILLs mid-sync and mid-segment.

The flow runs use the tiny random model with real Ray, real Prefect and MLflow on SQLite, as
``python -m trajflow.cli`` subprocesses (the module-scoped Prefect server of ``test_resume_replay_audit``).
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from tests.test_resume_replay_audit import STAGE_FILES, assert_same_weights, lab, ok, sha  # noqa: F401
from trajflow.config import load_config
from trajflow.errors import ConfigError
from trajflow.stages import partial_rollout as pr

pytestmark = pytest.mark.timeout(1800)

POOLS = "{train: {num_cpus_per_worker: 1}, gen: {num_cpus_per_worker: 1}}"
SPLIT = {"resources.placement": "split", "resources.pools": POOLS, "actor.pool": "train", "rollout.pool": "gen",
         "trainer.num_threads": 1, "rollout.dtype": "float32", "actor.mixed_precision.param_dtype": "float32"}


def _ov(**extra) -> list[str]:
    return [f"{k}={v}" for k, v in {**SPLIT, "trainer.partial_rollout": True, **extra}.items()]


# ---------------------------------------------------------------------------- config


@pytest.mark.parametrize("extra, needle", [
    ({"trainer.max_staleness": 0}, r"trainer.partial_rollout=true needs trainer.max_staleness >= 1 \(a row paused"),
    ({"trainer.max_staleness": 1, "rollout.multi_turn.enable": True},
     r"partial_rollout=true does not support rollout.multi_turn.enable=true: a paused episode would resume a turn"),
    ({"trainer.max_staleness": 1, "algorithm.filter_groups.enable": True},
     r"does not support algorithm.filter_groups.enable=true: dynamic sampling scores and refills whole batches"),
    ({"trainer.max_staleness": 2, "algorithm.adv_estimator": "remax"},
     r"does not support algorithm.adv_estimator='remax': ReMax's greedy baseline"),
    ({"trainer.max_staleness": 1, "rollout.engine": "vllm", "rollout.top_p": 0.9},
     r"rollout.engine=vllm needs rollout.top_p=1 and rollout.top_k=0: under a top-k/top-p filter"),
])
def test_unsupported_partial_rollouts_are_config_errors_naming_why(extra, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config(None, _ov(**extra))


def test_partial_rollouts_are_off_by_default_and_accepted_with_staleness():
    assert load_config(None, []).trainer.partial_rollout is False
    cfg = load_config(None, _ov(**{"trainer.max_staleness": 1, "model.lora_rank": 8}))  # LoRA: merged weights sync
    assert cfg.trainer.partial_rollout and cfg.algorithm.rollout_is == "token"


# ---------------------------------------------------------------------------- the pool by hand


def _pool(prompt_lens, generated, groups, versions=None, finish=None) -> pa.Table:
    """A pool of rows with prompts of ``prompt_lens`` tokens and ``generated`` response tokens so far."""
    rows = len(prompt_lens)
    versions = versions or [[0] * g for g in generated]
    t = pa.table({
        "sample_id": [f"{g}-s{i}" for i, g in enumerate(groups)], "group_id": groups,
        "iteration": pa.array([1] * rows, pa.int64()), "policy_version": pa.array([-1] * rows, pa.int64()),
        "prompt_ids": pa.array([[7] * n for n in prompt_lens], pa.list_(pa.int32())),
        "response_ids": pa.array([[]] * rows, pa.list_(pa.int32())),
        "response_text": [""] * rows, "rollout_logprobs": pa.array([[]] * rows, pa.list_(pa.float32())),
        "finish_reason": pa.array([None] * rows, pa.string())})
    pool = pr.new_pool_rows(t)
    for i, g in enumerate(generated):
        if g:
            pool = pr.apply_chunk(pool, [i], [[5] * g], [[-1.0] * g], ["length"], versions[i][0], 10**6, None)
    if versions:
        pool = pool.set_column(pool.schema.get_field_index(pr.TOKEN_VERSIONS), pr.TOKEN_VERSIONS,
                               pa.array(versions, pa.list_(pa.int64())))
    if finish is not None:
        pool = pool.set_column(pool.schema.get_field_index("finish_reason"), "finish_reason", pa.array(finish, pa.string()))
    return pool


def test_a_resumed_row_gets_what_is_left_of_its_own_budget_never_past_the_context():
    """By hand, ``max_new_tokens`` 12, chunks of 4, context 40: a row with 8 of its 12 tokens gets 4
    (not 12 again), one with 10 gets 2; a 30-token prompt with 6 generated has 40 - 36 = 4 left, one
    with 8 generated has 2 (a budget from the configured prompt length, 12 - 8 = 4, would overrun the
    context by 2); a row at the context's end is not requested and ends with ``length``."""
    pool = _pool([10, 10, 30, 30, 34, 10], [8, 10, 6, 8, 6, 0], ["a", "a", "b", "b", "c", "c"])
    reqs = pr.chunk_requests(pool, chunk=4, max_new_tokens=12, max_model_len=40)
    assert [(r.row, r.budget) for r in reqs] == [(0, 4), (1, 2), (2, 4), (3, 2), (5, 4)]
    assert reqs[1].token_ids == [7] * 10 + [5] * 10  # prompt + response so far: prefilled again
    # Each row takes its whole budget: rows 0 and 1 reach 12 tokens, 2 and 3 the context; row 4 had no room.
    rows = [r.row for r in reqs]
    pool = pr.apply_chunk(pool, rows, [[9] * r.budget for r in reqs], [[-0.5] * r.budget for r in reqs],
                          ["length"] * len(reqs), 3, 12, 40)
    lens = [len(x) for x in pool.column("response_ids").to_pylist()]
    assert lens == [12, 12, 10, 10, 6, 4]
    assert [p + g for p, g in zip([10, 10, 30, 30, 34, 10], lens)][2:5] == [40, 40, 40]  # never past 40
    assert pool.column("finish_reason").to_pylist() == ["length"] * 5 + [None]
    assert pool.column(pr.TOKEN_VERSIONS).to_pylist()[0] == [0] * 8 + [3] * 4
    assert pool.column("rollout_logprobs").to_pylist()[1] == [-1.0] * 10 + [-0.5] * 2


def test_a_chunk_ending_with_eos_stops_the_row_and_a_paused_row_stays_open():
    pool = _pool([5, 5], [0, 0], ["g", "g"])
    pool = pr.apply_chunk(pool, [0, 1], [[4, 2], [4, 4, 4]], [[-1, -2], [-1, -1, -1]], ["stop", "length"], 0, 8, None)
    assert pool.column("finish_reason").to_pylist() == ["stop", None]
    assert pr.complete_groups(pool) == []
    with pytest.raises(ValueError, match="2 tokens but 1 log-probs"):
        pr.apply_chunk(pool, [1], [[3, 3]], [[-1.0]], ["length"], 0, 8, None)


def test_groups_are_taken_oldest_first_and_counted_from_their_oldest_token():
    """Groups ``it000001-p0001`` (tokens of versions 0 and 1), ``it000002-p0000`` (version 1) and
    ``it000002-p0001`` (running): an iteration of 1 group at trainer version 2 takes the first, with
    ``policy_version`` 0 (its oldest token) and staleness 2 = max_staleness; at version 3 it would be
    too old. A group whose oldest token is version 0 must finish before an update at version 3 with
    max_staleness 2, one of version 1 may wait."""
    groups = ["it000001-p0001"] * 2 + ["it000002-p0000"] * 2 + ["it000002-p0001"] * 2
    versions = [[0, 0, 1], [0, 1], [1, 1], [1], [1], [1]]
    pool = _pool([3] * 6, [3, 2, 2, 1, 1, 1], groups, versions, finish=["stop"] * 4 + [None] * 2)
    assert pr.complete_groups(pool) == ["it000001-p0001", "it000002-p0000"]
    assert pr.must_finish_groups(pool, next_use_version=3, max_staleness=2) == {"it000001-p0001"}
    assert pr.segment_done(pool, 2, {"it000001-p0001"}) and not pr.segment_done(pool, 3, set())
    batch, rest = pr.take_batch(pool, 1, iteration=3, use_version=2, max_staleness=2, response_text=list("abcdef"))
    assert batch.column("group_id").to_pylist() == ["it000001-p0001"] * 2
    assert batch.column("policy_version").to_pylist() == [0, 0] and batch.column("iteration").to_pylist() == [3, 3]
    assert batch.column("response_text").to_pylist() == ["a", "b"] and rest.num_rows == 4
    with pytest.raises(ValueError, match="more than trainer.max_staleness=2 behind 3"):
        pr.take_batch(pool, 1, iteration=4, use_version=3, max_staleness=2, response_text=list("abcdef"))


def test_provenance_metrics_by_hand():
    """Rows with token versions [1, 1, 2, 2] and [2, 2] at trainer version 3: token staleness
    2, 2, 1, 1, 1, 1 (mean 8/6, max 2); rows (oldest token) 2 and 1 (mean 1.5); one of two rows spans
    two versions."""
    m = pr.provenance_metrics([[1, 1, 2, 2], [2, 2]], 3)
    assert m["rollout/staleness/token_mean"] == pytest.approx(8 / 6) and m["rollout/staleness/token_max"] == 2
    assert m["rollout/staleness/row_mean"] == 1.5 and m["rollout/staleness/row_max"] == 2
    assert m["rollout/partial/resumed_frac"] == 0.5 and m["rollout/partial/version_span_max"] == 1
    assert pr.provenance_metrics([], 3)["rollout/staleness/token_mean"] == 0.0


def test_chunk_sizes_seeds_and_depth():
    assert pr.chunk_size(0, 32) == 8 and pr.chunk_size(0, 2) == 1 and pr.chunk_size(5, 32) == 5
    assert pr.chunk_seed(7, 0, 4) == pr.chunk_seed(7, 0, 4) != pr.chunk_seed(7, 1, 4)
    assert [pr.rollout_depth(n) for n in (1, 2, 3)] == [0, 1, 1]


# ---------------------------------------------------------------------------- a row resumed under new weights


def _teacher_forced(model, prompt, response, temperature):
    """log softmax(logits / T)[token] of each response token, one plain forward over prompt + response."""
    ids = torch.tensor([list(prompt) + list(response)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].double() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1).numpy()


def test_a_paused_row_continues_under_new_weights_with_per_token_behaviour_logprobs(tiny_model_dir):
    """Three rows generate a 3-token chunk with weights A; the weights change to B; the rows continue
    from prompt + response so far (KV recomputed) with the 5 tokens left of 8. Each token's stored
    log-prob equals a teacher-forced forward under the weights that sampled it (A for tokens 0-2, B
    for 3-7), which the other weights do not give; the versions column says which."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trajflow.engines.hf import HFRolloutEngine
    from trajflow.stages.rollout import SamplingParams

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    prompts = [tok(t)["input_ids"] for t in ("Calculate 3 + 4.", "What is twelve minus five?", "Name a prime.")]
    engine = HFRolloutEngine(model, pad_id=tok.pad_token_id, eos_ids=[tok.eos_token_id], micro_batch_size=4)
    temperature = 0.9
    pool = _pool([len(p) for p in prompts], [0, 0, 0], ["g0", "g1", "g2"])
    pool = pool.set_column(pool.schema.get_field_index("prompt_ids"), "prompt_ids", pa.array(prompts, pa.list_(pa.int32())))
    weights_a = {k: v.clone() for k, v in model.state_dict().items()}
    for version in (0, 1):
        reqs = pr.chunk_requests(pool, chunk=3 if version == 0 else 6, max_new_tokens=8, max_model_len=1024)
        assert [r.budget for r in reqs] == ([3, 3, 3] if version == 0 else [5, 5, 5])
        out = engine.generate([r.token_ids for r in reqs], SamplingParams(n=1, temperature=temperature,
                              max_new_tokens=reqs[0].budget, seed=pr.chunk_seed(11, version, reqs[0].budget)))
        pool = pr.apply_chunk(pool, [r.row for r in reqs], out.response_ids, out.rollout_logprobs, out.finish_reason,
                              version, 8, 1024)
        if version == 0:
            assert pool.column("finish_reason").null_count == 3  # paused, not finished
            with torch.no_grad():  # the update: weights B
                for p in model.parameters():
                    p.add_(torch.randn_like(p) * 0.05)
    weights_b = {k: v.clone() for k, v in model.state_dict().items()}
    responses = pool.column("response_ids").to_pylist()
    assert [len(r) for r in responses] == [8, 8, 8] and pool.column("finish_reason").to_pylist() == ["length"] * 3
    assert pool.column(pr.TOKEN_VERSIONS).to_pylist() == [[0, 0, 0, 1, 1, 1, 1, 1]] * 3
    stored = pool.column("rollout_logprobs").to_pylist()
    for weights, span in ((weights_a, slice(0, 3)), (weights_b, slice(3, 8))):
        model.load_state_dict(weights)
        for p, r, lp in zip(prompts, responses, stored):
            expected = _teacher_forced(model, p, r, temperature)
            np.testing.assert_allclose(np.asarray(lp)[span], expected[span], atol=2e-4)
    model.load_state_dict(weights_a)  # under A, the tokens B sampled have other log-probs
    other = _teacher_forced(model, prompts[0], responses[0], temperature)
    assert np.abs(np.asarray(stored[0])[3:] - other[3:]).max() > 1e-3


# ---------------------------------------------------------------------------- the flow: schedule and kill -9


def _stage(run: Path, it: int, f: str):
    return pq.read_table(run / "iterations" / f"{it:06d}" / f)


def _written_at(run: Path, it: int, stage: str) -> float:
    return json.loads((run / "iterations" / f"{it:06d}" / "manifest.json").read_text())["files"][stage]["written_at"]


@pytest.fixture(scope="module")
def partial_runs(lab):
    """An uninterrupted partial-rollout run (``max_staleness=2``: one segment ahead of the update, rows
    may finish one segment later; 5 iterations, 8-token cap in chunks of 2, a checkpoint every 2), and
    the same run killed while iteration 5's segment loads its weight snapshot (mid-sync), resumed,
    killed again after that segment's first chunk went out (mid-pause: the rows carried from iteration
    4 half continued), and resumed to the end."""
    store = lab.store("partial")
    root = f"store.root={store}"
    fn = lab.named_reward()
    ov = {**SPLIT, "trainer.max_staleness": 2, "trainer.partial_rollout": True, "trainer.total_iterations": 5,
          "trainer.save_freq": 2, "rollout.partial_chunk_tokens": 2}
    out = {"store": store}
    out["ref"] = lab.cli("pr-ref", "train", *lab.overrides(store, shared_ray=False, **ov), "--run-id", "ref")
    out["k1"] = lab.cli("pr-k1", "train", *lab.overrides(store, shared_ray=False, **ov), "--run-id", "k",
                        fault="weight_sync:5")
    out["k1_checkpoints"] = sorted(p.name for p in (store / "k" / "checkpoints").iterdir())
    out["k1_written"] = {it: _written_at(store / "k", it, "inflight") for it in (3, 4)}
    out["k2"] = lab.cli("pr-k2", "resume", "k", root, fn, fault="rollout:5")
    out["k3"] = lab.cli("pr-k3", "resume", "k", root, fn)
    return out


def test_partial_schedule_versions_per_token_by_hand(partial_runs):
    """B = 2 groups of 2, 8 tokens in chunks of 2, the tiny model never samples EOS (every row runs 8
    tokens). Segment j runs version max(0, j - 2); the update of j starts from version j - 1.

    - segment 1 (v0): the pool's 4 groups run to the end (none completes earlier); it takes p0, p1;
    - segment 2 (v0): it takes it1's p2, p3 (complete, oldest first); one chunk starts it2's groups;
    - segment 3 (v1): it2's rows (oldest token v0) would be 3 > 2 versions old at update 4: finished
      (3 chunks, 6 tokens of v1), taken; it3's rows get 6 tokens of v1;
    - segment 4 (v2): it3's rows finish (2 tokens of v2); segment 5 (v3): it4's (2 of v2, 6 of v3).
    """
    ok(partial_runs["ref"])
    run = partial_runs["store"] / "ref"
    expected = {1: ("it000001", [0] * 8, 0), 2: ("it000001", [0] * 8, 1), 3: ("it000002", [0] * 2 + [1] * 6, 2),
                4: ("it000003", [1] * 6 + [2] * 2, 2), 5: ("it000004", [2] * 2 + [3] * 6, 2)}
    for it, (origin, versions, stale) in expected.items():
        r, a = _stage(run, it, "rollout.parquet"), _stage(run, it, "advantage.parquet")
        assert {g[:8] for g in r.column("group_id").to_pylist()} == {origin}
        assert r.column(pr.TOKEN_VERSIONS).to_pylist() == [versions] * 4
        assert r.column("policy_version").to_pylist() == [min(versions)] * 4  # the oldest token
        assert r.column("iteration").to_pylist() == [it] * 4
        assert a.column("staleness").to_pylist() == [stale] * 4 == [it - 1 - min(versions)] * 4
        # each token's behaviour log-prob is stored (the engine's, under its own version)
        assert [len(x) for x in r.column("rollout_logprobs").to_pylist()] == [8] * 4
        u = json.loads((run / "iterations" / f"{it:06d}" / "update.json").read_text())
        token_stale = [it - 1 - v for v in versions]
        assert u["rollout/staleness/token_mean"] == pytest.approx(np.mean(token_stale))
        assert u["rollout/staleness/row_max"] == stale == u["rollout_corr/staleness_max"]
        assert u["rollout/partial/resumed_frac"] == (1.0 if len(set(versions)) > 1 else 0.0)
        assert "rollout_corr/rollout_is_mean" in u  # the IS correction reads the per-token behaviour log-probs
    first = json.loads((run / "iterations" / "000001" / "update.json").read_text())
    assert first["rollout/partial/chunks"] == 4 and first["rollout/partial/inflight_rows"] == 4
    # iteration 1 drew two batches (the pool's two), the later ones one each
    assert [g[9:] for g in _stage(run, 2, "rollout.parquet").column("group_id").to_pylist()] == \
        ["p0002", "p0002", "p0003", "p0003"]
    inflight = _stage(run, 5, "inflight.parquet")  # it5's groups, 6 tokens of version 3 each, still running
    assert {g[:8] for g in inflight.column("group_id").to_pylist()} == {"it000005"}
    assert inflight.column("finish_reason").null_count == 4
    assert inflight.column(pr.TOKEN_VERSIONS).to_pylist() == [[3] * 6] * 4


def test_kill_mid_sync_and_mid_segment_resumes_to_the_uninterrupted_run(partial_runs):
    for name in ("k1", "k2"):
        step = partial_runs[name]
        assert step.rc == -signal.SIGKILL, f"{name} exited {step.rc}:\n{step.stderr[-3000:]}"
    ok(partial_runs["k3"])
    assert partial_runs["k1_checkpoints"] == ["000002"]
    store = partial_runs["store"]
    for it in range(1, 6):
        for f in (*STAGE_FILES, "inflight.parquet"):
            assert sha(store / "k" / "iterations" / f"{it:06d}" / f) == \
                sha(store / "ref" / "iterations" / f"{it:06d}" / f), f"iteration {it} {f} differs"
    assert_same_weights(store / "k" / "final" / "model.safetensors", store / "ref" / "final" / "model.safetensors")
    # The pools stored before the crash were read back, not regenerated, with their segments' metrics.
    assert {it: _written_at(store / "k", it, "inflight") for it in (3, 4)} == partial_runs["k1_written"]
    for it in (3, 4, 5):
        ref_m, k_m = (json.loads((store / r / "iterations" / f"{it:06d}" / "update.json").read_text()) for r in ("ref", "k"))
        keys = [key for key in ref_m if key.startswith(("rollout/", "rollout_corr/", "actor/"))]
        assert "rollout/partial/chunks" in keys and {key: k_m[key] for key in keys} == {key: ref_m[key] for key in keys}
    for name in ("k2", "k3"):
        assert "resuming run k from checkpoint 000002" in partial_runs[name].stdout


def test_lora_partial_rollouts_at_staleness_one_by_hand(tiny_model_dir, ray_local, tmp_path):
    """``max_staleness=1``: segment k runs after update k-1 (version k-1) and a row may be finished one
    segment later; with LoRA (the segments load the merged weights). B = 2 groups of 2, 8 tokens in
    chunks of 2, no EOS from the tiny model. By hand:

    - segment 1 (v0): 4 groups run to the end; it takes it1's p0, p1; p2, p3 wait (complete);
    - segment 2 (v1): it takes p2, p3 (staleness 1); one chunk starts it2's groups (2 tokens of v1);
    - segment 3 (v2): it2's rows (oldest token v1) would be 2 versions old at update 4: finished (6
      tokens of v2) and taken; staleness 1; segment 4 (v3): it3's rows, 6 tokens of v2 and 2 of v3.

    Iteration 1 is on-policy (the segment's weights are the trainer's): the engine's log-probs equal
    the trainer's. Validation after iterations 2 and 4 scores the policy between segments."""
    from tests.conftest import tiny_overrides
    from trajflow.flows.train import train

    lora = {"model.lora_rank": 4, "model.lora_alpha": 8, "actor.lr": 1e-3}
    ov = tiny_overrides(tiny_model_dir, tmp_path, **SPLIT, **lora, **{
        "trainer.max_staleness": 1, "trainer.partial_rollout": True, "trainer.total_iterations": 4,
        "trainer.test_freq": 2, "trainer.save_freq": 0, "rollout.partial_chunk_tokens": 2})
    run = Path(train(None, ov, run_id="lora-partial")["run_dir"])
    expected = {1: ("it000001", [0] * 8), 2: ("it000001", [0] * 8), 3: ("it000002", [1] * 2 + [2] * 6),
                4: ("it000003", [2] * 6 + [3] * 2)}
    for it, (origin, versions) in expected.items():
        r, a = _stage(run, it, "rollout.parquet"), _stage(run, it, "advantage.parquet")
        assert {g[:8] for g in r.column("group_id").to_pylist()} == {origin}
        assert r.column(pr.TOKEN_VERSIONS).to_pylist() == [versions] * 4
        assert a.column("staleness").to_pylist() == [it - 1 - min(versions)] * 4 == [0 if it == 1 else 1] * 4
    first = json.loads((run / "iterations" / "000001" / "update.json").read_text())
    assert first["actor/rollout_logprob_diff"] < 1e-4 and first["rollout/staleness/token_max"] == 0
    meta = json.loads((run / "run.json").read_text())
    assert "validation_000002" in meta and "validation_000004" in meta
    last = json.loads((run / "iterations" / "000004" / "update.json").read_text())
    assert last["rollout/staleness/token_mean"] == pytest.approx(0.75) and last["rollout/partial/resumed_frac"] == 1.0
