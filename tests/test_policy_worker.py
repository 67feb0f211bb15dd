"""The policy worker without Ray: on-policy ratio exactly 1, checkpoint round trip."""

import numpy as np
import pytest
import torch

from trajflow.stages.policy_update import UpdateBatch, UpdateRows, UpdateSettings
from trajflow.stages.rollout import SamplingParams
from trajflow.config import ActorConfig, ModelConfig, RolloutConfig
from trajflow.modeling.forward import forward_micro_batch
from trajflow.modeling.packing import pack
from trajflow.workers.policy import PolicyWorker

ACTOR = dict(lr=1e-3, betas=[0.9, 0.999], weight_decay=0.0, ppo_micro_batch_size=2, ppo_epochs=1, shuffle=False,
             policy_loss="vanilla", clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0,
             loss_agg_mode="token-mean", entropy_coeff=0.0, kl_loss_coef=0.0, kl_loss_type="low_var_kl",
             grad_clip=1.0)
MODEL = ModelConfig(dtype="float32")


def _rollout_cfg(temperature=0.7):
    return RolloutConfig(micro_batch_size=4, temperature=temperature)


@pytest.fixture
def worker(tiny_model_dir):
    return PolicyWorker(str(tiny_model_dir), ActorConfig(**ACTOR), MODEL, _rollout_cfg(), seed=0, num_threads=1)


def _rollout(worker, temperature=0.7):
    prompts = worker.tokenize_prompts([[{"role": "user", "content": "Calculate 3 + 4."}],
                                       [{"role": "user", "content": "Calculate 12 - 5 please."}]], 256)
    params = SamplingParams(n=2, temperature=temperature, max_new_tokens=6, seed=1)
    out = worker.generate_sequences(prompts, params)
    rows = [p for p in prompts for _ in range(2)]
    return rows, out


def _batch(rows, out, mini_rows, advantages=None):
    adv = advantages or [[1.0 if i % 2 else -1.0] * len(r) for i, r in enumerate(out.response_ids)]
    return UpdateBatch(UpdateRows(rows, out.response_ids, out.rollout_logprobs, adv), UpdateSettings(mini_rows))


def test_recomputed_old_logprobs_give_ratio_exactly_one(worker):
    # Two mini-batches: the trainer recomputes old log-probs before the first step with the
    # update's own packing, so the first step's ratio is 1 bit for bit (temperature 0.7).
    rows, out = _rollout(worker, temperature=0.7)
    worker.model.train()
    packed = pack(rows[:2], out.response_ids[:2], worker.pad_id)
    logp, _ = forward_micro_batch(worker.model, packed, 0.7)
    recomputed = worker.compute_log_prob(rows, out.response_ids, 0.7)
    for j in range(2):
        n = len(out.response_ids[j])
        assert torch.equal(torch.exp(logp[j, :n].detach() - torch.from_numpy(recomputed[j])), torch.ones(n))
    metrics = worker.update_actor(_batch(rows, out, mini_rows=2))
    assert metrics["actor/ratio_first_step_max_abs_dev"] == 0.0
    assert metrics["policy_version"] == 1


def test_single_step_update_is_on_policy_and_matches_rollout_logprobs(worker):
    rows, out = _rollout(worker, temperature=0.7)
    metrics = worker.update_actor(_batch(rows, out, mini_rows=4))
    assert metrics["actor/ratio_first_step_max_abs_dev"] == 0.0
    assert metrics["actor/pg_clipfrac"] == 0.0 and metrics["actor/ppo_kl"] == 0.0
    # The engine's sampling log-probs agree with the trainer's at the same temperature.
    assert metrics["actor/rollout_logprob_diff"] < 1e-4


def test_rollout_logprobs_use_the_sampling_temperature(worker):
    rows, out = _rollout(worker, temperature=0.7)
    same = worker.compute_log_prob(rows, out.response_ids, 0.7)
    other = worker.compute_log_prob(rows, out.response_ids, 1.0)
    assert all(np.allclose(a, b, atol=1e-4) for a, b in zip(same, out.rollout_logprobs))
    assert not all(np.allclose(a, b, atol=1e-2) for a, b in zip(other, out.rollout_logprobs))


def test_generation_is_a_function_of_the_seed(worker):
    _, a = _rollout(worker)
    _, b = _rollout(worker)
    assert a.response_ids == b.response_ids


def test_checkpoint_round_trip(worker, tiny_model_dir, tmp_path):
    rows, out = _rollout(worker)
    batch = _batch(rows, out, 4, [[0.5] * len(r) for r in out.response_ids])
    worker.update_actor(batch)
    worker.save_checkpoint(str(tmp_path / "ck"))
    other = PolicyWorker(str(tiny_model_dir), ActorConfig(**ACTOR), MODEL, _rollout_cfg(), seed=5, num_threads=1)
    other.load_checkpoint(str(tmp_path / "ck"))
    assert other.weights_digest() == worker.weights_digest()
    assert other.policy_version == 1
    # The optimizer state came along: the next identical update gives identical weights.
    worker.update_actor(batch)
    other.update_actor(batch)
    assert other.weights_digest() == worker.weights_digest()


def test_entropy_bonus_is_the_only_gradient_when_advantages_are_zero(tiny_model_dir):
    # With zero advantages and no KL the policy-gradient loss has zero gradient, so the gradient
    # norm is the entropy bonus's: zero without it, positive with it.
    norms = {}
    for coeff in (0.0, 0.01):
        w = PolicyWorker(str(tiny_model_dir), ActorConfig(**(ACTOR | {"entropy_coeff": coeff})), MODEL,
                         _rollout_cfg(), seed=0, num_threads=1)
        rows, out = _rollout(w)
        batch = _batch(rows, out, mini_rows=4, advantages=[[0.0] * len(r) for r in out.response_ids])
        norms[coeff] = w.update_actor(batch)["actor/grad_norm"]
    assert norms[0.0] == 0.0 and norms[0.01] > 0.0


def test_token_budget_slices_by_hand():
    from trajflow.modeling.packing import micro_batch_plan, token_budget_slices

    prompts = [[1, 2, 3]] * 3 + [[4, 5]]
    responses = [[9, 9], [9, 9, 9], [9], [9, 9, 9, 9]]
    # Budget 8: row 0 costs 3 + 2 = 5; row 1 shares its prompt, 3 more (8); row 2 would make 9, so a new
    # micro-batch pays its prompt again, 3 + 1 = 4; row 3 has another prompt, 2 + 4 = 6 -> 10 > 8.
    assert token_budget_slices(prompts, responses, 8) == [slice(0, 2), slice(2, 3), slice(3, 4)]
    # A row over the budget on its own still gets a micro-batch (the budget never drops a row).
    assert token_budget_slices(prompts, responses, 3) == [slice(0, 1), slice(1, 2), slice(2, 3), slice(3, 4)]
    assert token_budget_slices(prompts, responses, 100) == [slice(0, 4)]
    assert token_budget_slices([], [], 8) == []
    with pytest.raises(ValueError, match="ppo_max_token_len_per_gpu must be >= 1"):
        token_budget_slices(prompts, responses, 0)
    assert micro_batch_plan(prompts, responses, 3) == [slice(0, 3), slice(3, 4)]
    assert micro_batch_plan(prompts, responses, 3, max_tokens=8) == [slice(0, 2), slice(2, 3), slice(3, 4)]


def test_dynamic_micro_batches_update_like_fixed_ones(tiny_model_dir):
    # The same batch, one optimizer step: 2-row micro-batches vs token-budget micro-batches (a budget
    # that cuts the 4 rows into 3 pieces) vs the whole mini-batch at once. Gradient accumulation is
    # exact, so the weights agree to float rounding; a lost or doubled micro-batch moves them ~1e-3.
    from trajflow.modeling.packing import micro_batch_plan

    weights = {}
    for name, extra in (("fixed", {}), ("dynamic", {"use_dynamic_bsz": True}), ("whole", {"ppo_micro_batch_size": 4})):
        w = PolicyWorker(str(tiny_model_dir), ActorConfig(**{**ACTOR, **extra}), MODEL, _rollout_cfg(1.0),
                         seed=0, num_threads=1)
        before = {k: v.detach().clone() for k, v in w.model.state_dict().items()}
        rows, out = _rollout(w, temperature=1.0)
        if name == "dynamic":
            lens = [len(p) + len(r) for p, r in zip(rows, out.response_ids)]
            budget = max(lens) + 1  # room for a row and its group partner's response, rarely more
            w.actor.ppo_max_token_len_per_gpu = budget
            plan = micro_batch_plan(rows, out.response_ids, 2, budget)
            assert len(plan) >= 2 and [sl.stop - sl.start for sl in plan] != [2, 2], plan
        m = w.update_actor(_batch(rows, out, mini_rows=4))
        assert m["actor/ratio_first_step_max_abs_dev"] == 0.0
        weights[name] = {k: v.detach().clone() for k, v in w.model.state_dict().items()}
        assert max(float((weights[name][k] - before[k]).abs().max()) for k in before) > 1e-4  # it did step
    for name in ("dynamic", "whole"):
        for k, v in weights["fixed"].items():
            assert torch.allclose(weights[name][k], v, atol=1e-6, rtol=0), (name, k)


def test_split_generations_merge_in_row_order():
    # 3 prompts, 2 samples each; rank 0 got prompts [0, 2], rank 1 prompt [1] plus one padding prompt.
    from trajflow.stages.rollout import Generation
    from trajflow.workers.group import merge_split

    g0 = Generation([[1], [2], [5], [6]], ["a", "b", "e", "f"], ["stop"] * 4, [[-1.0], [-2.0], [-5.0], [-6.0]], 3,
                    {"timing_s/gen": 1.0, "timing_s/old_log_prob": 0.5})
    g1 = Generation([[3], [4], [9], [9]], ["c", "d", "x", "x"], ["length"] * 4, [[-3.0], [-4.0], [-9.0], [-9.0]], 3,
                    {"timing_s/gen": 2.0, "timing_s/old_log_prob": 0.25})
    out = merge_split([g0, g1], [[0, 2], [1]], [0, 1], 3)
    assert out == Generation([[1], [2], [3], [4], [5], [6]], list("abcdef"), ["stop", "stop", "length", "length",
                             "stop", "stop"], [[-1.0], [-2.0], [-3.0], [-4.0], [-5.0], [-6.0]], 3,
                             {"timing_s/gen": 2.0, "timing_s/old_log_prob": 0.5})
    greedy = [Generation([[1]], ["a"], ["stop"], None, 0, {"timing_s/gen": 1.0}),
              Generation([[2]], ["b"], ["stop"], None, 0, {"timing_s/gen": 1.5})]
    assert merge_split(greedy, [[0], [1]], [0, 0], 2).rollout_logprobs is None


def test_the_scheduled_learning_rate_reaches_the_optimizer(worker):
    """A warmup's first iteration (lr 0) leaves the weights as they are; the next one's rate is used."""
    rows, out = _rollout(worker, temperature=0.7)
    before = {k: v.detach().clone() for k, v in worker.model.state_dict().items()}
    batch = _batch(rows, out, mini_rows=4)
    metrics = worker.update_actor(UpdateBatch(batch.rows, UpdateSettings(4, lr=0.0)))
    assert metrics["actor/lr"] == 0.0 and metrics["actor/grad_norm"] > 0
    assert all(torch.equal(before[k], v) for k, v in worker.model.state_dict().items())
    metrics = worker.update_actor(UpdateBatch(batch.rows, UpdateSettings(4, lr=3e-4)))
    assert metrics["actor/lr"] == 3e-4
    assert not all(torch.equal(before[k], v) for k, v in worker.model.state_dict().items())
