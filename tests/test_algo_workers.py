"""The critic and reward-model workers, and the policy worker's rollout-IS path, run in-process
(plain classes; the pipeline runs the same classes as Ray actors) with tiny random-weight models."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from trajflow.stages.critic_update import CriticBatch, CriticRows, CriticSettings
from trajflow.stages.policy_update import UpdateBatch, UpdateRows, UpdateSettings
from tests.algo_helpers import make_tiny_reward_model
from trajflow.config import CriticConfig, ModelConfig, RewardModelConfig

MODEL_CFG = ModelConfig(dtype="float32", attn_implementation="sdpa")
CRITIC_CFG = {"lr": 1e-2, "cliprange_value": 0.5, "ppo_epochs": 1, "ppo_micro_batch_size": 2, "grad_clip": 0.0}
PROMPTS = [[1, 2, 3, 4], [5, 6], [7, 8, 9]]
RESPONSES = [[10, 11], [12, 13, 14, 15], [16]]


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    return make_tiny_reward_model(tmp_path_factory.mktemp("tiny-rm"))


def _critic(model_dir):
    from trajflow.workers.critic import CriticWorker

    return CriticWorker(str(model_dir), CriticConfig(**CRITIC_CFG), MODEL_CFG, "cpu", 1)


def _critic_batch(values, returns, loss_mask=None, mini_batch_rows=3):
    return CriticBatch(CriticRows(PROMPTS, RESPONSES, values, returns, loss_mask), CriticSettings(mini_batch_rows))


# ------------------------------------------------------------------------------------------ critic


def test_critic_values_read_the_state_before_each_response_token(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    worker = _critic(tiny_model_dir)
    with torch.no_grad():  # a non-zero head so that every position has its own value
        worker.model.value_head.weight.copy_(torch.linspace(-1, 1, worker.model.value_head.weight.numel()).reshape(1, -1))
        worker.model.value_head.bias.fill_(0.3)
    vals = worker.compute_values(PROMPTS, RESPONSES)  # micro-batches of 2: rows 0 and 1 are padded together
    # Independently: each row alone (no padding); V(s_t) is the head applied to the hidden state of the
    # token just before response token t (position len(prompt) - 1 + t of prompt + response).
    lm = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    W = worker.model.value_head.weight.detach()[0].numpy().astype(np.float64)
    for p, r, v in zip(PROMPTS, RESPONSES, vals):
        with torch.no_grad():
            h = lm.get_decoder()(input_ids=torch.tensor([p + r])).last_hidden_state[0].double().numpy()
        expected = h[len(p) - 1:len(p) - 1 + len(r)] @ W + 0.3
        assert v.dtype == np.float32 and v.shape == (len(r),)
        np.testing.assert_allclose(v, expected, atol=1e-5)


def test_critic_update_first_step_by_hand_and_learning(tiny_model_dir):
    worker = _critic(tiny_model_dir)
    values = worker.compute_values(PROMPTS, RESPONSES)
    assert all(np.all(v == 0.0) for v in values)  # the value head starts at zero
    returns = [[1.0, 2.0], [0.0, 1.0, 2.0, 3.0], [5.0]]
    m = worker.update_critic(_critic_batch(values, returns))
    # V = V_old = 0, so clipping is inactive: 0.5 * mean over the 7 tokens of R^2
    flat = np.concatenate(returns)
    assert m["critic/vf_loss"] == pytest.approx(0.5 * np.mean(flat ** 2), rel=1e-6)
    assert m["critic/vf_clipfrac"] == 0.0 and m["critic/vpred_mean"] == 0.0
    # explained variance of V = 0: 1 - Var[R] / (Var[R] + 1e-5) (unbiased variances)
    var = np.var(flat, ddof=1)
    assert m["critic/vf_explained_var"] == pytest.approx(1 - var / (var + 1e-5), abs=1e-9)
    assert m["critic/grad_norm"] > 0 and m["critic/lr"] == 1e-2
    for key in ("critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean", "critic/vf_explained_var", "critic/grad_norm"):
        assert key in m
    # iterating (fresh values each round, as the pipeline does) fits the returns
    losses = []
    for _ in range(15):
        losses.append(worker.update_critic(_critic_batch(worker.compute_values(PROMPTS, RESPONSES), returns))
                      ["critic/vf_loss"])
    assert losses[-1] < 0.5 * losses[0]


def test_critic_loss_mask_and_value_clipping(tiny_model_dir):
    worker = _critic(tiny_model_dir)
    values = worker.compute_values(PROMPTS, RESPONSES)
    returns = [[1.0, 1.0], [3.0, 3.0, 3.0, 3.0], [1.0]]
    mask = [[1.0, 1.0], [0.0, 0.0, 0.0, 0.0], [1.0]]  # row 1 quarantined
    m = worker.update_critic(_critic_batch(values, returns, mask))
    assert m["critic/vf_loss"] == pytest.approx(0.5 * 1.0, rel=1e-6)  # only the three tokens with R = 1
    # old values 10 above the returns and the current prediction 0: the clipped prediction 9.5 is the
    # worse one, so the loss is 0.5 * (9.5 - 1)^2 and every token counts as clipped
    far = [np.full(len(r), 10.0, np.float32) for r in RESPONSES]
    worker2 = _critic(tiny_model_dir)
    m2 = worker2.update_critic(_critic_batch(far, [[1.0] * len(r) for r in RESPONSES]))
    assert m2["critic/vf_loss"] == pytest.approx(0.5 * 8.5 ** 2, rel=1e-6)
    assert m2["critic/vf_clipfrac"] == 1.0


def test_critic_checkpoint_round_trip(tiny_model_dir, tmp_path):
    worker = _critic(tiny_model_dir)
    returns = [[1.0] * len(r) for r in RESPONSES]
    worker.update_critic(_critic_batch(worker.compute_values(PROMPTS, RESPONSES), returns))
    worker.save_checkpoint(str(tmp_path / "critic"))
    restored = _critic(tiny_model_dir)
    assert restored.weights_digest() != worker.weights_digest()
    assert restored.load_checkpoint(str(tmp_path / "critic")) == {"optimizer_steps": 1}
    assert restored.weights_digest() == worker.weights_digest()
    # the optimizer state came back too: the next step is identical
    batch = _critic_batch(worker.compute_values(PROMPTS, RESPONSES), returns)
    worker.update_critic(batch)
    restored.update_critic(batch)
    assert restored.weights_digest() == worker.weights_digest()


# ------------------------------------------------------------------------------------------ reward model


def _rm(rm_dir, micro_batch_size=2, max_length=2048):
    from trajflow.workers.reward_model import RewardModelWorker

    return RewardModelWorker(str(rm_dir), RewardModelConfig(micro_batch_size=micro_batch_size, max_length=max_length),
                             MODEL_CFG, "cpu", 1)


CHATS = [[{"role": "user", "content": "What is 2 + 2?"}],
         [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi."}],
         [{"role": "user", "content": "Calculate 3 + 5."}]]
ANSWERS = ["4", "Hello there, how can I help you today?", "3 + 5 = 8\nAnswer: 8"]


def _reference_score(rm_dir, chat, answer, max_length=None):
    """The model's head at the last token of the unpadded chat (independent of the worker's batching)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(rm_dir))
    model = AutoModelForSequenceClassification.from_pretrained(str(rm_dir), dtype=torch.float32)
    ids = tok.apply_chat_template(chat + [{"role": "assistant", "content": answer}], tokenize=True,
                                  add_generation_prompt=False)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    if max_length:
        ids = ids[-max_length:]
    with torch.no_grad():
        h = model.model(input_ids=torch.tensor([ids])).last_hidden_state[0, -1]
        return float(model.score(h)[0])


def test_reward_model_scores_match_unpadded_forward(rm_dir):
    scores = _rm(rm_dir).compute_rm_score(CHATS, ANSWERS)  # micro-batches of 2: padding in the first
    assert scores.dtype == np.float32 and scores.shape == (3,)
    expected = [_reference_score(rm_dir, c, a) for c, a in zip(CHATS, ANSWERS)]
    np.testing.assert_allclose(scores, expected, atol=1e-5)
    assert len(set(np.round(scores, 4))) == 3  # the rows really differ
    # truncation keeps the last max_length tokens
    short = _rm(rm_dir, max_length=6).compute_rm_score(CHATS[:1], ANSWERS[:1])
    assert short[0] == pytest.approx(_reference_score(rm_dir, CHATS[0], ANSWERS[0], max_length=6), abs=1e-5)


def test_reward_model_needs_one_label(tmp_path):
    from trajflow.errors import ModelLoadError

    bad = make_tiny_reward_model(tmp_path / "two", num_labels=2)
    with pytest.raises(ModelLoadError, match="2 labels; a reward model needs exactly 1"):
        _rm(bad)
    with pytest.raises(ModelLoadError, match="reward.reward_model.path"):
        _rm(tmp_path / "missing")


# ------------------------------------------------------------------------------------------ policy worker


def _policy(model_dir, *overrides):
    from trajflow.config import load_config
    from trajflow.workers.policy import PolicyWorker

    cfg = load_config(None, ["actor.ppo_micro_batch_size=2", *overrides])
    sections = [OmegaConf.to_object(cfg[s]) for s in ("actor", "model", "rollout")]
    return PolicyWorker(str(model_dir), *sections, 0, "cpu", 1)


ADV = [[1.0, -0.5], [0.25, 0.25, -1.0, 2.0], [0.75]]


def test_rollout_is_weights_from_engine_log_probs_that_differ(tiny_model_dir):
    """The engine gave every token half the trainer's probability: pi_old / pi_rollout = 2 per token."""
    trainer_lp = _policy(tiny_model_dir).compute_log_prob(PROMPTS, RESPONSES, 1.0)
    engine_lp = [lp - np.float32(np.log(2.0)) for lp in trainer_lp]
    rows = UpdateRows(PROMPTS, RESPONSES, engine_lp, ADV)
    plain = _policy(tiny_model_dir).update_actor(UpdateBatch(rows))
    # one on-policy step: the PPO ratio is 1, so token-mean of -A over the 7 tokens
    assert plain["actor/pg_loss"] == pytest.approx(-sum(map(sum, ADV)) / 7, rel=1e-5)
    assert plain["actor/rollout_logprob_diff"] == pytest.approx(np.log(2.0), rel=1e-5)
    # No correction: no IS-weight statistics, but the mismatch is measured every iteration:
    # d = log pi_rollout - log pi_old = -log 2 on every token, rho = pi_old / pi_rollout = 2.
    assert not any(k.startswith("rollout_corr/rollout_is") for k in plain)
    assert plain["rollout_corr/kl"] == pytest.approx(-np.log(2.0), rel=1e-5)
    assert plain["rollout_corr/max_abs_diff"] == pytest.approx(np.log(2.0), rel=1e-5)
    assert plain["rollout_corr/k3_kl"] == pytest.approx(2.0 - np.log(2.0) - 1.0, rel=1e-4)
    assert plain["rollout_corr/ppl_ratio"] == pytest.approx(0.5, rel=1e-5)

    # token level, C = 1.5: every weight is min(2, 1.5) = 1.5
    tok = _policy(tiny_model_dir).update_actor(UpdateBatch(rows, UpdateSettings(rollout_is="token",
                                                                                 rollout_is_threshold=1.5)))
    assert tok["actor/pg_loss"] == pytest.approx(1.5 * plain["actor/pg_loss"], rel=1e-5)
    assert tok["rollout_corr/rollout_is_clipfrac"] == 1.0
    assert tok["rollout_corr/rollout_is_mean"] == pytest.approx(1.5, rel=1e-6)
    assert tok["rollout_corr/rollout_is_max"] == pytest.approx(2.0, rel=1e-5)
    assert tok["rollout_corr/log_ratio_mean"] == pytest.approx(np.log(2.0), rel=1e-5)

    # sequence level, C = 3: rows of 2, 4 and 1 tokens have weights min(2^2, 3) = 3, min(2^4, 3) = 3 and 2
    seq = _policy(tiny_model_dir).update_actor(UpdateBatch(rows, UpdateSettings(rollout_is="sequence",
                                                                                 rollout_is_threshold=3.0)))
    want = -(3 * sum(ADV[0]) + 3 * sum(ADV[1]) + 2 * sum(ADV[2])) / 7
    assert seq["actor/pg_loss"] == pytest.approx(want, rel=1e-5)
    assert seq["rollout_corr/rollout_is_clipfrac"] == pytest.approx(2 / 3)
    assert seq["rollout_corr/rollout_is_mean"] == pytest.approx((3 + 3 + 2) / 3, rel=1e-5)


def test_rollout_rejection_drops_the_outlying_row(tiny_model_dir):
    """Row 1's engine log-probs are log 2 below the trainer's (ratio 2 per token), rows 0 and 2 match: IcePop
    and geometric rejection with bound 1.5 drop row 1's tokens from the loss (the token-mean denominator
    stays 7), sequence rejection too (its product 2^4 = 16)."""
    trainer_lp = _policy(tiny_model_dir).compute_log_prob(PROMPTS, RESPONSES, 1.0)
    engine_lp = [lp - np.float32(np.log(2.0)) if i == 1 else lp.copy() for i, lp in enumerate(trainer_lp)]
    rows = UpdateRows(PROMPTS, RESPONSES, engine_lp, ADV)
    want = -(sum(ADV[0]) + sum(ADV[2])) / 7
    for level in ("token", "sequence", "geometric"):
        worker = _policy(tiny_model_dir)
        peak = 1e-3 if level == "token" else None  # perf/mfu/actor needs a peak; a CPU has none of its own
        m = worker.update_actor(UpdateBatch(rows, UpdateSettings(rollout_rs=level, rollout_rs_threshold=1.5,
                                                                 peak_tflops=peak)))
        if peak:  # model FLOPs over the update's time (at most timing_s/update_actor) and a 1 GFLOP/s peak
            from trajflow.modeling.flops import train_flops
            flops = train_flops(worker.model, [len(p) + len(r) for p, r in zip(PROMPTS, RESPONSES)])
            assert m["perf/mfu/actor"] >= flops / (m["timing_s/update_actor"] * 1e9)
        else:
            assert "perf/mfu/actor" not in m
        assert m["actor/pg_loss"] == pytest.approx(want, rel=1e-5, abs=1e-6), level
        assert m["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(4 / 7), level
        assert m["rollout_corr/rollout_rs_seq_masked_fraction"] == pytest.approx(1 / 3), level
        assert m["rollout_corr/rollout_rs_kept_kl"] == pytest.approx(0.0, abs=1e-6), level
    assert m["rollout_corr/rollout_rs_max"] == pytest.approx(2.0, rel=1e-5)  # geometric: row 1's mean ratio


def test_dr_grpo_normaliser_is_the_response_cap_for_every_micro_batch(tiny_model_dir):
    """seq-mean-token-sum-norm divides by rollout.max_new_tokens (verl pads responses to it), not by the
    longest response of each micro-batch, so micro-batches of different widths add up exactly."""
    worker = _policy(tiny_model_dir, "actor.loss_agg_mode=seq-mean-token-sum-norm", "rollout.max_new_tokens=16")
    old = worker.compute_log_prob(PROMPTS, RESPONSES, 1.0)
    m = worker.update_actor(UpdateBatch(UpdateRows(PROMPTS, RESPONSES, old, ADV)))
    # ratio 1: sum_i sum_t (-A_it) / H / N with H = 16 and N = 3 rows
    assert m["actor/pg_loss"] == pytest.approx(-sum(map(sum, ADV)) / 16 / 3, rel=1e-5)


def test_critic_metrics_are_token_means_across_mini_batches(tiny_model_dir):
    """lr = 0: both optimizer steps see the same critic. Mini-batches of 2 and 1 rows hold 6 and 1
    tokens, so ``critic/vpred_mean`` must be the mean over all 7 tokens of the predicted values, by
    hand from compute_values, not the mean of the two steps' means."""
    from trajflow.workers.critic import CriticWorker

    worker = CriticWorker(str(tiny_model_dir), CriticConfig(**{**CRITIC_CFG, "lr": 0.0}), MODEL_CFG, "cpu", 1)
    with torch.no_grad():
        worker.model.value_head.weight.copy_(torch.linspace(-1, 1, worker.model.value_head.weight.numel()).reshape(1, -1))
        worker.model.value_head.bias.fill_(0.3)
    vals = worker.compute_values(PROMPTS, RESPONSES)
    want = float(np.concatenate(vals).astype(np.float64).mean())
    m = worker.update_critic(_critic_batch([v.tolist() for v in vals], [[0.0] * len(r) for r in RESPONSES],
                                           mini_batch_rows=2))
    assert m["critic/vpred_mean"] == pytest.approx(want, rel=1e-5)
