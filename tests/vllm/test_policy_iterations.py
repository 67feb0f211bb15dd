"""Training iterations of the LoRA and tool-calculator recipes with vLLM as the rollout engine, in one
process: the policy worker (float32 trainer) drives the session's real vLLM engines (bf16) through
rollout -> update -> weight sync -> rollout, and a second worker resumes from the first one's
checkpoint. The recipes' runs through the whole train flow (Ray, Prefect, kill and resume) use the
same worker methods; these tests check what the engine adds to them: the adapter (never merged) or
the full weights reach vLLM after each update, vLLM's log-probs are the trainer's within bf16
tolerance before and after, and multi-turn episodes keep the model's tokens, the loss mask and the
template's tokens between turns."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from trajflow.stages.policy_update import UpdateBatch, UpdateRows, UpdateSettings
from trajflow.stages.rollout import SamplingParams
from tests.vllm.test_engine import BF16_MAX, BF16_MEAN, PROMPTS, score, teacher_forced
from trajflow.config import ActorConfig, ModelConfig, RolloutConfig
from trajflow.engines.base import WeightSync
from trajflow.workers.policy import PolicyWorker

# A large step (Adam moves every weight by ~lr): the update must move log-probs far beyond bf16 noise.
ACTOR = dict(lr=1e-2, betas=[0.9, 0.999], weight_decay=0.0, ppo_micro_batch_size=4, ppo_epochs=1, shuffle=False,
             policy_loss="vanilla", clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0,
             loss_agg_mode="token-mean", entropy_coeff=0.0, kl_loss_coef=0.0, kl_loss_type="low_var_kl",
             grad_clip=1.0)
TEMPERATURE = 0.8


def masked_diffs(engine_lps, trainer_lps, masks=None) -> torch.Tensor:
    """|engine - trainer| per token over every row (only where the mask is 1)."""
    out = []
    for i, (a, b) in enumerate(zip(engine_lps, trainer_lps)):
        a, b = torch.tensor(a, dtype=torch.float64), torch.as_tensor(np.asarray(b), dtype=torch.float64)
        keep = torch.ones(len(a), dtype=torch.bool) if masks is None else torch.tensor(masks[i], dtype=torch.bool)
        out.append((a - b)[keep].abs())
    return torch.cat(out)


def signed_advantages(response_ids):
    """+1 on even rows, -1 on odd ones: a real policy-gradient step with both signs."""
    return [[1.0 if i % 2 == 0 else -1.0] * len(r) for i, r in enumerate(response_ids)]


@pytest.mark.parametrize("sync", ["adapter", "merged"])
def test_lora_recipe_iterations_sync_and_resume(sync, request, vllm_model_dir, hf_model, tmp_path):
    """grpo_lora over vLLM: after every update the engine serves the new policy, either as the adapter
    (a ``LoRARequest``, never merged: GPUs) or as merged weights (CPUs, the default there); a worker
    restored from the checkpoint makes the engine serve the same policy again."""
    eng = request.getfixturevalue("lora_engine" if sync == "adapter" else "engine")
    model_cfg = ModelConfig(dtype="float32", lora_rank=8, lora_alpha=16.0)
    rollout = RolloutConfig(engine="hf", temperature=TEMPERATURE, max_new_tokens=10)

    def worker_on_engine():
        w = PolicyWorker(str(vllm_model_dir), ActorConfig(**ACTOR), model_cfg, rollout, seed=0)
        w._set_engine(eng)
        return w

    worker = worker_on_engine()
    assert worker.weight_sync is (WeightSync.ADAPTER if sync == "adapter" else WeightSync.FULL)
    worker._push_weights()  # what load_checkpoint and attach do: the engine serves this worker's policy
    prompts, params = PROMPTS, SamplingParams(n=4, temperature=TEMPERATURE, max_new_tokens=10, seed=7)
    rows = [p for p in prompts for _ in range(4)]
    try:
        gen = worker.generate_sequences(prompts, params)
        assert gen.policy_version == 0 and len(gen.response_ids) == 8
        trainer0 = worker.compute_log_prob(rows, gen.response_ids, TEMPERATURE)
        d = masked_diffs(gen.rollout_logprobs, trainer0)
        assert d.mean() < BF16_MEAN and d.max() < BF16_MAX, (d.mean(), d.max())

        ids_before = eng.lora_request.lora_int_id if sync == "adapter" else None
        metrics = worker.update_actor(UpdateBatch(UpdateRows(rows, gen.response_ids, gen.rollout_logprobs,
                                                             signed_advantages(gen.response_ids)), UpdateSettings()))
        assert metrics["policy_version"] == 1 and metrics["actor/ratio_first_step_max_abs_dev"] == 0.0
        # vLLM's sampling log-probs against the trainer's recomputed ones, inside the update: bf16 noise only.
        assert metrics["actor/rollout_logprob_diff"] < BF16_MEAN
        if sync == "adapter":
            assert eng.lora_request.lora_int_id != ids_before and eng.lora_request.lora_name == "policy-v1"
        else:
            assert eng.lora_request is None  # merged weights, no adapter in vLLM

        gen2 = worker.generate_sequences(prompts, params)
        trainer1 = worker.compute_log_prob(rows, gen2.response_ids, TEMPERATURE)
        d = masked_diffs(gen2.rollout_logprobs, trainer1)
        assert d.mean() < BF16_MEAN and d.max() < BF16_MAX, (d.mean(), d.max())
        # ... and they are the updated policy's, not the base model's: the update moved them by far more.
        base = [teacher_forced(hf_model, p, r, TEMPERATURE).numpy() for p, r in zip(rows, gen2.response_ids)]
        assert masked_diffs(gen2.rollout_logprobs, base).mean() > 3 * d.mean() + 0.1
        if sync == "adapter":  # the base weights inside vLLM were never rewritten: without the adapter, the base
            cont = [28, 253, 1789, 30, 216, 2683]
            served_base = torch.tensor(score(eng, PROMPTS[0], cont))
            assert (served_base - teacher_forced(hf_model, PROMPTS[0], cont, 1.0)).abs().max() < BF16_MAX

        # Kill and resume at the worker level: the engine back at the initial policy, a fresh worker
        # loads the checkpoint and pushes its weights.
        worker.save_checkpoint(str(tmp_path / "actor"))
        restored = worker_on_engine()
        restored._push_weights()
        again = restored.generate_sequences(prompts, params)  # the initial policy again, not the updated one
        d = masked_diffs(again.rollout_logprobs, restored.compute_log_prob(rows, again.response_ids, TEMPERATURE))
        assert d.mean() < BF16_MEAN and d.max() < BF16_MAX
        assert restored.load_checkpoint(str(tmp_path / "actor"))["policy_version"] == 1
        gen3 = restored.generate_sequences(prompts, params)
        d = masked_diffs(gen3.rollout_logprobs, restored.compute_log_prob(rows, gen3.response_ids, TEMPERATURE))
        assert d.mean() < BF16_MEAN and d.max() < BF16_MAX
        assert gen3.response_ids == gen2.response_ids  # same seed, same weights: the same samples
    finally:
        if sync == "merged":
            eng.update_weights({k: v.detach() for k, v in hf_model.state_dict().items()})  # the session's model


@pytest.fixture
def sandbox_ok():
    """Whether the tool sandbox must be allowed to run weaker than asked on this kernel."""
    from trajflow.envs.sandbox import Sandbox

    probe = Sandbox([], allow_weaker=True)
    probe.probe_isolation()
    return bool(probe.missing)


def test_tool_recipe_iterations_over_vllm_keep_masks_prefixes_and_sync_weights(engine, vllm_model_dir, hf_model, tok,
                                                                                sandbox_ok):
    """grpo_tool_calculator's loop over vLLM: episodes with calculator calls run in the sandbox (scripted,
    since a random model writes no calls: tests/mt_envs.py), the policy update on their loss mask, the
    full weights synced to vLLM, and a second rollout on the new weights."""
    from trajflow.config.schema import MultiTurnConfig

    mt = MultiTurnConfig(enable=True, environment="tests.mt_envs:scripted_calls", max_assistant_turns=3,
                         max_user_turns=2, max_tokens_per_turn=12, max_tool_response_length=64,
                         allow_weaker_sandbox=sandbox_ok)
    rollout = RolloutConfig(engine="hf", temperature=TEMPERATURE, max_new_tokens=160, multi_turn=mt)
    worker = PolicyWorker(str(vllm_model_dir), ActorConfig(**ACTOR), ModelConfig(dtype="float32"), rollout, seed=0)
    worker._set_engine(engine)
    assert worker.weight_sync is WeightSync.FULL
    eos = tok.eos_token_id
    rows = [{"messages": [{"role": "user", "content": f"What is {k}234 + 5678?"}], "ground_truth": "0",
             "data_source": "basic_arithmetic_tool", "extra_info": {}, "prompt_id": str(k)} for k in range(3)]
    rows = [r for r in rows for _ in range(2)]
    params = SamplingParams(temperature=TEMPERATURE, seed=3)
    # The random model seldom samples <|im_end|>: the engine also stops on the tokens it writes most often
    # after these prompts, so turns end ("stop") and the environment answers (as in test_episodes_lora.py).
    probe = worker.generate_episodes(rows, params).episodes
    frequent = [t for t, _ in Counter(t for e in probe for t in e.response_ids).most_common(4)]
    saved = engine.eos_ids
    engine.eos_ids = saved + frequent
    try:
        first = worker.generate_episodes(rows, params)
        eps = first.episodes
        check_episodes(eps, tok, eos, frequent)
        trainer0 = worker.compute_log_prob([e.prompt_ids for e in eps], [e.response_ids for e in eps], TEMPERATURE)
        masks = [e.loss_mask for e in eps]
        d = masked_diffs([e.rollout_logprobs for e in eps], trainer0, masks)
        tol = bf16_tolerance(worker.model, eps)
        assert d.mean() < tol[0] and d.max() < tol[1], (d.mean(), d.max(), tol)

        batch = UpdateBatch(UpdateRows([e.prompt_ids for e in eps], [e.response_ids for e in eps],
                                       [e.rollout_logprobs for e in eps], signed_advantages([e.response_ids for e in eps]),
                                       loss_mask=masks), UpdateSettings())
        metrics = worker.update_actor(batch)
        assert metrics["policy_version"] == 1 and metrics["actor/ratio_first_step_max_abs_dev"] == 0.0
        # The update's own engine-vs-trainer comparison counts the model's tokens only: the same mean as above.
        assert metrics["actor/rollout_logprob_diff"] == pytest.approx(float(d.mean()), rel=1e-3)

        # The update changed what the model writes most: stop on the new policy's frequent tokens too.
        engine.eos_ids = saved
        probe = worker.generate_episodes(rows, params).episodes
        frequent += [t for t, _ in Counter(t for e in probe for t in e.response_ids).most_common(4)]
        engine.eos_ids = saved + frequent
        second = worker.generate_episodes(rows, params).episodes
        check_episodes(second, tok, eos, frequent)
        masks = [e.loss_mask for e in second]
        new = worker.compute_log_prob([e.prompt_ids for e in second], [e.response_ids for e in second], TEMPERATURE)
        d = masked_diffs([e.rollout_logprobs for e in second], new, masks)
        tol = bf16_tolerance(worker.model, second)
        assert d.mean() < tol[0] and d.max() < tol[1], (d.mean(), d.max(), tol)
        # ... the updated policy's, not the initial one's: the update moved them by far more than that.
        old = [teacher_forced(hf_model, e.prompt_ids, e.response_ids, TEMPERATURE).numpy() for e in second]
        assert masked_diffs([e.rollout_logprobs for e in second], old, masks).mean() > 3 * d.mean() + 0.1
    finally:
        engine.eos_ids = saved
        engine.update_weights({k: v.detach() for k, v in hf_model.state_dict().items()})  # the session's model


def bf16_tolerance(model, eps) -> tuple[float, float]:
    """Tolerances (mean, worst) of a bf16 engine against the float32 trainer at the episodes' model
    tokens: twice what bf16 rounding alone costs the trainer's own log-probs there (autocast vs
    float32), at least the short-prompt tolerances. On prompts of ~240 tokens (the tools block) this
    random model's large activations make bf16's own error about a tenth of a nat on average."""
    fp32, bf16 = [], []
    for e in eps:
        fp32.append(teacher_forced(model, e.prompt_ids, e.response_ids, TEMPERATURE).numpy())
        with torch.autocast("cpu", dtype=torch.bfloat16):
            bf16.append(teacher_forced(model, e.prompt_ids, e.response_ids, TEMPERATURE).float().numpy())
    noise = masked_diffs(bf16, fp32, [e.loss_mask for e in eps])
    return max(BF16_MEAN, 2 * float(noise.mean())), max(BF16_MAX, 2 * float(noise.max()))


def check_episodes(eps, tok, eos, frequent):
    """Every turn: the model's tokens as sampled (mask 1, its log-probs), then exactly the chat template's
    tokens for the tool result (mask 0, log-prob 0): the conversation so far is a prefix of the next prompt."""
    ran = 0
    for ep in eps:
        assert len(ep.response_ids) == len(ep.loss_mask) == len(ep.rollout_logprobs) <= 160
        spans = list(zip(ep.turn_spans[::2], ep.turn_spans[1::2]))
        assert spans and spans[0][0] == 0
        for k, ((a, b), nxt) in enumerate(zip(spans, spans[1:] + [(len(ep.response_ids), None)])):
            assert ep.loss_mask[a:b] == [1] * (b - a) and 1 <= b - a <= 12
            assert all(lp < 0.0 for lp in ep.rollout_logprobs[a:b])
            assert ep.loss_mask[b:nxt[0]] == [0] * (nxt[0] - b)
            assert all(lp == 0.0 for lp in ep.rollout_logprobs[b:nxt[0]])
            if nxt[1] is None:
                continue
            turn = ep.response_ids[a:b]
            assert turn[-1] in [eos] + frequent  # the turn ended on a stop token, kept as sampled
            result = ep.tool_calls[k]["result"]
            closing = "" if turn[-1] == eos else "<|im_end|>"
            text = f"{closing}\n<|im_start|>tool\n{result}<|im_end|>\n<|im_start|>assistant\n"
            assert ep.response_ids[b:nxt[0]] == tok(text, add_special_tokens=False)["input_ids"]
            ran += 1
        if ep.finish_reason == "stop":  # the script: calculator, an unknown tool, done
            assert [c["name"] for c in ep.tool_calls] == ["calculator", "search"]
            assert ep.tool_calls[0]["result"] == "7006652" and ep.tool_calls[1]["error"]
    assert ran >= 2, [e.finish_reason for e in eps]
