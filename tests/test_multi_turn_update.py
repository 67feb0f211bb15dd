"""The policy update on multi-turn rows: masked observation tokens are context, never loss.

The worker packs rows as prompt + response (tree packing with shared prompts on the tiny model); the
gradient it backpropagates must equal the one of a loss written by hand over a plain, unpacked
forward that keeps only the tokens with ``loss_mask`` 1.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trajflow.stages.policy_update import UpdateBatch, UpdateRows, UpdateSettings
from tests.multi_turn_rows import episode
from trajflow.config import ActorConfig, ModelConfig, RolloutConfig
from trajflow.modeling.forward import uses_tree_packing
from trajflow.modeling.packing import pack
from trajflow.workers.policy import PolicyWorker

TEMPERATURE = 0.7
ACTOR = dict(lr=1e-3, betas=[0.9, 0.999], weight_decay=0.0, ppo_micro_batch_size=2, ppo_epochs=1, shuffle=False,
             policy_loss="vanilla", clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0,
             loss_agg_mode="token-mean", entropy_coeff=0.0, kl_loss_coef=0.0, kl_loss_type="low_var_kl",
             grad_clip=1.0)


@pytest.fixture
def worker(tiny_model_dir):
    return PolicyWorker(str(tiny_model_dir), ActorConfig(**ACTOR), ModelConfig(dtype="float32"),
                        RolloutConfig(micro_batch_size=4, temperature=TEMPERATURE, max_new_tokens=64), seed=0,
                        num_threads=1)


def episodes(tokenizer):
    ask = [{"role": "user", "content": "What is 17 * 23? Use the calculator."}]
    other = [{"role": "user", "content": "Add 5 and 9."}]
    return [
        episode(tokenizer, ask, [("17 * 23", "391"), ("Answer: 391", None)]),
        episode(tokenizer, ask, [("17*23", "391"), ("23 * 17", "391"), ("Answer: 392", None)]),  # same prompt
        episode(tokenizer, other, [("5 + 9", "14"), ("Answer: 14", None)]),
    ]


def plain_logprobs(model, prompt_ids, response_ids):
    """log pi(y_t | context) at ``TEMPERATURE`` and the token entropies, from one unpacked forward."""
    ids = torch.tensor([prompt_ids + response_ids])
    logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1:-1].float() / TEMPERATURE
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, torch.tensor(response_ids)[:, None])[:, 0]
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def hand_grads(model, eps, advantages, count_all=False):
    """Gradient of the token-mean PPO loss at ratio 1, -sum_t A_t log pi(y_t) / N, over the trainable tokens
    (or, ``count_all``, every response token). Returns (grads by name, loss value, entropy mean)."""
    model.zero_grad(set_to_none=True)
    masks = [torch.ones(len(e["loss_mask"])) if count_all else torch.tensor(e["loss_mask"], dtype=torch.float32)
             for e in eps]
    n = sum(float(m.sum()) for m in masks)
    total, ent = 0.0, 0.0
    for e, a, m in zip(eps, advantages, masks):
        logp, entropy = plain_logprobs(model, e["prompt_ids"], e["response_ids"])
        (-(torch.tensor(a) * logp * m).sum() / n).backward()
        total += float(-(torch.tensor(a) * m).sum()) / n
        ent += float((entropy.detach() * m).sum()) / n
    grads = {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads, total, ent


def capture_grads(model):
    """The accumulated gradient of every parameter after each backward (the last one is the step's)."""
    seen = {}
    handles = [p.register_post_accumulate_grad_hook(lambda p, k=k: seen.__setitem__(k, p.grad.detach().clone()))
               for k, p in model.named_parameters()]
    return seen, handles


def test_update_gradient_is_the_hand_loss_over_trainable_tokens(worker):
    eps = episodes(worker.tokenizer)
    assert [sum(e["loss_mask"]) < len(e["loss_mask"]) for e in eps] == [True] * 3
    packed = pack([e["prompt_ids"] for e in eps[:2]], [e["response_ids"] for e in eps[:2]], worker.pad_id)
    assert uses_tree_packing(worker.model, packed)  # the first micro-batch shares its prompt in one tree
    rng = np.random.default_rng(0)
    # Advantages on observation tokens are garbage on purpose: the mask alone must keep them out.
    advantages = [[float(x) if m else 50.0 for x, m in zip(rng.normal(size=len(e["loss_mask"])), e["loss_mask"])]
                  for e in eps]
    expected, pg_loss, entropy = hand_grads(worker.model, eps, advantages)
    counted_all, _, _ = hand_grads(worker.model, eps, advantages, count_all=True)
    old = [plain_logprobs(worker.model, e["prompt_ids"], e["response_ids"])[0].detach().tolist() for e in eps]
    rows = UpdateRows([e["prompt_ids"] for e in eps], [e["response_ids"] for e in eps], old, advantages,
                      loss_mask=[e["loss_mask"] for e in eps])
    seen, handles = capture_grads(worker.model)
    try:
        metrics = worker.update_actor(UpdateBatch(rows, UpdateSettings(mini_batch_rows=3)))
    finally:
        for h in handles:
            h.remove()
    assert set(seen) == set(expected)
    for k, g in expected.items():
        torch.testing.assert_close(seen[k], g, rtol=1e-4, atol=1e-7, msg=k)
    assert not all(torch.allclose(seen[k], counted_all[k], rtol=1e-3, atol=1e-6) for k in expected)
    assert metrics["actor/pg_loss"] == pytest.approx(pg_loss, rel=1e-5, abs=1e-7)
    assert metrics["actor/entropy"] == pytest.approx(entropy, rel=1e-4)
    norm = torch.sqrt(sum((g.double() ** 2).sum() for g in expected.values()))
    assert metrics["actor/grad_norm"] == pytest.approx(float(norm), rel=1e-4)


def test_engine_comparisons_skip_observation_tokens(worker):
    # The engine's log-probs are the trainer's on generated tokens and 0.0 on observation tokens (the
    # contract): the engine-vs-trainer difference and the rollout IS weights must see no gap at all.
    eps = episodes(worker.tokenizer)
    old = [[v if m else 0.0 for v, m in zip(plain_logprobs(worker.model, e["prompt_ids"], e["response_ids"])[0]
                                          .detach().tolist(), e["loss_mask"])] for e in eps]
    rows = UpdateRows([e["prompt_ids"] for e in eps], [e["response_ids"] for e in eps], old,
                      [[1.0] * len(e["loss_mask"]) for e in eps], loss_mask=[e["loss_mask"] for e in eps])
    metrics = worker.update_actor(UpdateBatch(rows, UpdateSettings(mini_batch_rows=3, rollout_is="sequence",
                                                                   rollout_is_threshold=2.0)))
    assert metrics["actor/rollout_logprob_diff"] < 1e-5
    assert metrics["rollout_corr/rollout_is_mean"] == pytest.approx(1.0, abs=1e-4)
    assert metrics["rollout_corr/rollout_is_clipfrac"] == 0.0


def test_critic_fits_generated_tokens_only(tiny_model_dir):
    # Interior mask from the rollout, times the gate's quarantine (row 2), through the stage's own
    # batch builders. The value head starts at 0, so clipping is inactive and the first loss is
    # 0.5 * mean of R^2 over the generated tokens of the kept rows; the observation tokens' returns
    # (100) must not count.
    import pyarrow as pa
    from omegaconf import OmegaConf

    from trajflow.stages.critic_update import critic_batch
    from trajflow.stages.policy_update import with_loss_mask
    from trajflow.config import CriticConfig
    from trajflow.workers.critic import CriticWorker

    masks = [[1, 1, 0, 0, 1], [1, 0, 0, 1], [1, 1]]
    returns = [[1.0, 2.0, 100.0, 100.0, 3.0], [4.0, 100.0, 100.0, 5.0], [7.0, 7.0]]
    joined = pa.table({
        "sample_id": ["a", "b", "c"],
        "prompt_ids": pa.array([[1, 2, 3], [1, 2, 3], [4, 5]], pa.list_(pa.int32())),
        "response_ids": pa.array([[10, 11, 12, 13, 14], [15, 16, 17, 18], [19, 20]], pa.list_(pa.int32())),
        "loss_mask": pa.array(masks, pa.list_(pa.int8())),
        "values": pa.array([[0.0] * len(m) for m in masks], pa.list_(pa.float32())),
        "returns": pa.array(returns, pa.list_(pa.float32())),
    })
    cfg = OmegaConf.create({"actor": {"ppo_mini_batch_size": 3, "shuffle": False}, "rollout": {"n": 1},
                            "trainer": {"seed": 0}})
    batch = critic_batch(with_loss_mask(joined, {"quarantined_sample_ids": ["c"]}), 1, cfg)
    critic = CriticWorker(str(tiny_model_dir), CriticConfig(lr=1e-2, cliprange_value=0.5, ppo_epochs=1,
                                                            ppo_micro_batch_size=2, grad_clip=0.0),
                          ModelConfig(dtype="float32"), "cpu", 1)
    m = critic.update_critic(batch)
    kept = np.array([1.0, 2.0, 3.0, 4.0, 5.0])
    assert m["critic/vf_loss"] == pytest.approx(0.5 * np.mean(kept ** 2), rel=1e-6)
    var = np.var(kept, ddof=1)
    assert m["critic/vf_explained_var"] == pytest.approx(1 - var / (var + 1e-5), abs=1e-9)
