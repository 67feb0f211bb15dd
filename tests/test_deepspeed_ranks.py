"""DeepSpeed data parallel on CPU (gloo): 2 ranks as 2 Ray actors vs the one-process update.

Tolerance: the 2-rank update differs from the 1-rank one only in float summation order (gradients
are summed across ranks by an all-reduce / reduce-scatter instead of inside one backward), so the
weights after one AdamW step agree to a few float32 ulps of the gradient; we allow
``atol = 1e-5 * max|w|`` (weights here are O(1); lr = 1e-3, so a wrong gradient, a wrong
denominator or a missing micro-batch moves weights by ~1e-3 and fails the check; measured
differences are ~5e-7).
"""

from __future__ import annotations

import dataclasses
import numpy as np
import pytest

from trajflow.stages.policy_update import UpdateBatch, UpdateRows, UpdateSettings
from trajflow.config import ActorConfig, ModelConfig, RolloutConfig
from trajflow.workers.group import WorkerGroup

ACTOR = dict(lr=1e-3, betas=[0.9, 0.999], weight_decay=0.01, ppo_micro_batch_size=2, ppo_epochs=1, shuffle=False,
             policy_loss="vanilla", clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0,
             loss_agg_mode="token-mean", entropy_coeff=0.0, kl_loss_coef=0.1, kl_loss_type="low_var_kl",
             grad_clip=1.0)
MODEL = ModelConfig(dtype="float32")
ROLLOUT = RolloutConfig(micro_batch_size=4, temperature=1.0)


def make_batch(worker, seed: int = 0, rows: int = 10) -> UpdateBatch:
    """Random prompts/responses of varied lengths, on-policy old log-probs, mixed advantages, a masked row."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(10, 2000, size=int(n)).tolist() for n in rng.integers(3, 14, size=rows)]
    resps = [rng.integers(10, 2000, size=int(n)).tolist() for n in rng.integers(1, 10, size=rows)]
    old = worker.compute_log_prob(prompts, resps, 1.0)
    mask = [[0.0 if i == 3 else 1.0] * len(r) for i, r in enumerate(resps)]
    rows = UpdateRows(prompts, resps, [x.tolist() for x in old], [[float(rng.normal())] * len(r) for r in resps],
                      loss_mask=mask, ref_logprobs=[(x - 0.05).tolist() for x in old])
    # 5 rows per optimizer step: ranks get 3 + 2 rows, so one rank runs a padding micro-batch.
    return UpdateBatch(rows, UpdateSettings(mini_batch_rows=5))


def spawn_ds(model_dir, zero_stage: int, world: int = 2, **extra) -> WorkerGroup:
    from trajflow.workers.policy import PolicyWorker

    actor = ActorConfig(**{**ACTOR, "strategy": "deepspeed", "zero_stage": zero_stage, "world_size": world, **extra})
    group = WorkerGroup.spawn(PolicyWorker, (str(model_dir), actor, MODEL, ROLLOUT, 0, "cpu", 1),
                              [{"num_cpus": 0}] * world, "actor", lockstep=zero_stage == 3)
    group.init_distributed()
    return group


def assert_close(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    scale = max(float(np.abs(v).max()) for v in a.values())
    worst = max(float(np.abs(a[k] - b[k]).max()) for k in a)
    assert worst <= 1e-5 * scale, (worst, scale)


@pytest.fixture(scope="module")
def one_rank(tiny_model_dir):
    """The reference: the plain single-process worker (torch AdamW), two updates on two batches."""
    from trajflow.workers.policy import PolicyWorker

    w = PolicyWorker(str(tiny_model_dir), ActorConfig(**ACTOR), MODEL, ROLLOUT, seed=0, num_threads=1)
    b1 = make_batch(w, 0)
    w0 = w.get_weights()
    m1 = w.update_actor(b1)
    w1 = w.get_weights()
    b2 = make_batch(w, 1)
    w.update_actor(b2)
    return {"b1": b1, "b2": b2, "w0": w0, "w1": w1, "w2": w.get_weights(), "m1": m1}


def test_zero2_two_ranks_update_equals_one_rank(ray_local, tiny_model_dir, one_rank):
    group = spawn_ds(tiny_model_dir, zero_stage=2)
    try:
        m = group.execute("update_actor", one_rank["b1"])
        w = group.execute("get_weights")
        assert_close(w, one_rank["w1"])
        assert max(float(np.abs(w[k] - one_rank["w0"][k]).max()) for k in w) > 1e-4  # the step did move weights
        for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm", "actor/ppo_kl"):
            assert m[key] == pytest.approx(one_rank["m1"][key], rel=1e-4, abs=1e-6), key
        assert m["policy_version"] == 1
    finally:
        group.kill()


def test_zero2_token_budget_micro_batches_equal_one_rank(ray_local, tiny_model_dir, one_rank):
    # Micro-batches by token budget (use_dynamic_bsz): each rank cuts its 3 or 2 rows by tokens, so the
    # ranks can need different numbers of micro-batches; the shorter one pads with zero-weighted copies.
    from trajflow.modeling.packing import balanced_partition, token_budget_slices

    b1, budget = one_rank["b1"], 14
    mini = list(range(5))
    weights = [len(b1.rows.prompt_ids[r]) + len(b1.rows.response_ids[r]) for r in mini]
    counts = [len(token_budget_slices([b1.rows.prompt_ids[r] for r in p], [b1.rows.response_ids[r] for r in p],
                                      budget))
              for p in balanced_partition(weights, 2)]
    assert counts[0] != counts[1] and max(counts) > 1, counts  # uneven: the padding path runs
    group = spawn_ds(tiny_model_dir, zero_stage=2, use_dynamic_bsz=True, ppo_max_token_len_per_gpu=budget)
    try:
        group.execute("update_actor", b1)
        assert_close(group.execute("get_weights"), one_rank["w1"])
    finally:
        group.kill()


def test_zero3_checkpoint_save_load_export(ray_local, tiny_model_dir, one_rank, tmp_path):
    from transformers import AutoModelForCausalLM

    group = spawn_ds(tiny_model_dir, zero_stage=3)
    try:
        group.execute("update_actor", one_rank["b1"])
        w1 = group.execute("get_weights")
        assert_close(w1, one_rank["w1"])  # ZeRO-3 update == one-process update as well
        group.execute("save_checkpoint", str(tmp_path / "ck"))
        group.execute("update_actor", one_rank["b2"])
        w2 = group.execute("get_weights")
        assert_close(w2, one_rank["w2"])
    finally:
        group.kill()
    shards = sorted(p.name for p in (tmp_path / "ck" / "deepspeed" / "latest").iterdir())
    assert sum("optim_states" in s for s in shards) == 2  # one optimizer shard per rank

    fresh = spawn_ds(tiny_model_dir, zero_stage=3)
    try:
        assert fresh.execute("load_checkpoint", str(tmp_path / "ck")) == {"policy_version": 1}
        loaded = fresh.execute("get_weights")
        assert all(np.array_equal(loaded[k], w1[k]) for k in w1)
        fresh.execute("export_hf", str(tmp_path / "hf"))
        model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
        exported = {k: v.detach().numpy() for k, v in model.state_dict().items()}
        assert all(np.array_equal(exported[k], w1[k]) for k in w1)
        # The optimizer state came back too: the same second update gives the same weights.
        fresh.execute("update_actor", one_rank["b2"])
        assert_close(fresh.execute("get_weights"), w2)
    finally:
        fresh.kill()
    from tests.test_export import assert_offline_export_equals

    # `trajflow export` of the ZeRO-3 checkpoint, offline (DeepSpeed's zero_to_fp32 over weights-only loads).
    assert_offline_export_equals(tmp_path / "ck", {"path": str(tiny_model_dir)}, tmp_path / "hf", tmp_path / "offline",
                                 "deepspeed")


def nan_batch(batch: UpdateBatch) -> UpdateBatch:
    """``batch`` with one row's advantages NaN: the loss, hence every gradient, is not finite."""
    adv = [list(a) for a in batch.rows.advantages]
    adv[1] = [float("nan")] * len(adv[1])
    return UpdateBatch(dataclasses.replace(batch.rows, advantages=adv), batch.settings)



@pytest.fixture(scope="module")
def one_rank_nan(tiny_model_dir, one_rank):
    """The one-process worker on the batch whose first mini-batch has a NaN advantage: that step is
    skipped (weights and AdamW state untouched), the second mini-batch's step is taken."""
    from trajflow.workers.policy import PolicyWorker

    w = PolicyWorker(str(tiny_model_dir), ActorConfig(**ACTOR), MODEL, ROLLOUT, seed=0, num_threads=1)
    m = w.update_actor(nan_batch(one_rank["b1"]))
    return {"w": w.get_weights(), "m": m}


@pytest.mark.parametrize("zero_stage,dtype", [(0, "float32"), (3, "float32"), (0, "bfloat16")])
def test_a_non_finite_gradient_skips_the_step_on_every_rank(ray_local, tiny_model_dir, one_rank, one_rank_nan,
                                                            zero_stage, dtype):
    # DeepSpeed checks for overflow only where its optimizer does (ZeRO-1/2, the bf16/fp16 optimizers):
    # the plain ZeRO-0 fp32 step applied a NaN gradient while the metrics said it was skipped.
    from trajflow.config import MixedPrecisionConfig

    assert one_rank_nan["m"]["actor/grad_norm_nonfinite"] == 1.0
    group = spawn_ds(tiny_model_dir, zero_stage=zero_stage, mixed_precision=MixedPrecisionConfig(param_dtype=dtype))
    try:
        m = group.execute("update_actor", nan_batch(one_rank["b1"]))
        w = group.execute("get_weights")
    finally:
        group.kill()
    assert m["actor/grad_norm_nonfinite"] == 1.0 and m["actor/nonfinite_steps_in_a_row"] == 0.0
    assert all(np.isfinite(w[k]).all() for k in w)
    if dtype == "float32":  # first step skipped, second taken: as the one-process update
        assert_close(w, one_rank_nan["w"])
    else:  # bf16 compute (DeepSpeed's bf16 optimizer): the second step was taken
        assert np.isfinite(m["actor/grad_norm"])
        assert max(float(np.abs(w[k] - one_rank["w0"][k]).max()) for k in w) > 1e-4


def metric_batch(worker) -> tuple[UpdateBatch, dict]:
    """Rows of uneven lengths whose engine log-probs are the trainer's plus a known offset per row,
    cut into 2 mini-batches (4 + 3 rows) of 2-row micro-batches; and the token-level metrics by hand.

    With lr = 0 the weights never move, so every step sees the initial policy and the token means
    over the whole update are plain token means over all rows: ``actor/rollout_logprob_diff`` =
    sum_r n_r |d_r| / sum_r n_r and ``actor/entropy`` = the mean over all response tokens of
    -sum_v p log p under the initial model (a plain Hugging Face forward)."""
    import torch

    rng = np.random.default_rng(7)
    lengths = [9, 1, 2, 8, 1, 7, 3]
    prompts = [rng.integers(10, 2000, size=4).tolist() for _ in lengths]
    resps = [rng.integers(10, 2000, size=n).tolist() for n in lengths]
    trainer = worker.compute_log_prob(prompts, resps, 1.0)
    offsets = [0.05 * (i + 1) * (-1) ** i for i in range(len(lengths))]
    rollout = [(x + d).tolist() for x, d in zip(trainer, offsets)]
    rows = UpdateRows(prompts, resps, rollout, [[0.5 * (-1) ** i] * n for i, n in enumerate(lengths)])
    diff = sum(n * abs(d) for n, d in zip(lengths, offsets)) / sum(lengths)
    ent = []
    with torch.no_grad():
        for p, r in zip(prompts, resps):
            logits = worker.model(input_ids=torch.tensor([p + r])).logits[0, len(p) - 1:-1].double()
            lp = torch.log_softmax(logits, -1)
            ent.extend((-(lp.exp() * lp).sum(-1)).tolist())
    return UpdateBatch(rows, UpdateSettings(mini_batch_rows=4)), {"actor/rollout_logprob_diff": diff,
                                                                   "actor/entropy": float(np.mean(ent))}


def test_token_metrics_are_token_means_across_micro_batches_mini_batches_and_ranks(ray_local, tiny_model_dir):
    from trajflow.workers.policy import PolicyWorker

    w = PolicyWorker(str(tiny_model_dir), ActorConfig(**{**ACTOR, "lr": 0.0}), MODEL, ROLLOUT, seed=0, num_threads=1)
    batch, want = metric_batch(w)
    one = w.update_actor(batch)
    for key, value in want.items():
        assert one[key] == pytest.approx(value, rel=1e-5), key
    group = spawn_ds(tiny_model_dir, zero_stage=2, lr=0.0)
    try:
        two = group.execute("update_actor", batch)
    finally:
        group.kill()
    for key, value in want.items():  # 2 ranks, each with its own uneven share of every mini-batch
        assert two[key] == pytest.approx(value, rel=1e-5), key
