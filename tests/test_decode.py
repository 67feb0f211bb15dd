"""trajflow's decode loop (``HFRolloutEngine._decode``): rows that emit EOS leave the batch, and
nothing else changes. Greedy tokens equal plain ``generate`` on each prompt alone cut at its first
EOS, and sampled tokens' log-probs equal the teacher-forced forward's, when rows end at different
steps."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from trajflow.stages.rollout import SamplingParams
from trajflow.engines.hf import HFRolloutEngine
from trajflow.modeling.forward import compute_log_probs

MAX_NEW = 10


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _prompts(tok):
    return [tok(t)["input_ids"] for t in ("Solve it. Calculate 3 + 4.", "Solve it. What is twelve minus five?",
                                          "Name a prime number larger than ten.")]


def _plain_greedy(model, tok, prompt, n_tokens):
    ids = torch.tensor([prompt])
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_tokens, do_sample=False,
                         eos_token_id=[tok.eos_token_id], pad_token_id=tok.pad_token_id)
    return out[0, len(prompt):].tolist()


def _cut(tokens, eos):
    """``tokens`` up to and including the first id in ``eos`` (by hand: what a response is)."""
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[:i + 1]
    return tokens


def test_greedy_rows_that_stop_early_leave_the_batch_without_changing_the_others(model, tok):
    prompts = _prompts(tok)
    refs = [_plain_greedy(model, tok, p, MAX_NEW) for p in prompts]
    # An extra "EOS" id that one prompt's greedy continuation emits early and another's never does,
    # so rows end at different steps of one batch.
    stop = next(t for r in refs for t in r[:5] if any(t not in other for other in refs))
    eos = [tok.eos_token_id, stop]
    expected = [_cut(r, eos) for r in refs]
    assert min(map(len, expected)) < MAX_NEW == max(map(len, expected))
    engine = HFRolloutEngine(model, pad_id=tok.pad_token_id, eos_ids=eos, micro_batch_size=6)
    out = engine.generate(prompts, SamplingParams(n=2, temperature=0.0, max_new_tokens=MAX_NEW, seed=0))
    assert out.rollout_logprobs is None
    for i, ref in enumerate(expected):
        assert out.response_ids[2 * i] == out.response_ids[2 * i + 1] == ref
        reason = "stop" if ref[-1] in eos else "length"
        assert out.finish_reason[2 * i] == out.finish_reason[2 * i + 1] == reason


def test_sampled_rows_that_stop_early_change_nothing_else_and_keep_teacher_forced_logprobs(model, tok):
    prompts = _prompts(tok)
    params = SamplingParams(n=4, temperature=0.8, top_p=0.9, max_new_tokens=MAX_NEW, seed=7)
    base = HFRolloutEngine(model, pad_id=tok.pad_token_id, eos_ids=[tok.eos_token_id], micro_batch_size=12)
    full = base.generate(prompts, params)
    # Make a token that some rows sample early, and others never, end a response: those rows then
    # leave the batch. Each row has its own uniform draws, so the others' samples must not change,
    # and the early rows must be their old samples cut at that token.
    stop = next(t for r in full.response_ids for t in r[:5]
                if any(t not in other for other in full.response_ids))
    eos = [tok.eos_token_id, stop]
    engine = HFRolloutEngine(model, pad_id=tok.pad_token_id, eos_ids=eos, micro_batch_size=12)
    out = engine.generate(prompts, params)
    expected = [_cut(r, eos) for r in full.response_ids]
    assert out.response_ids == expected
    assert min(map(len, expected)) < MAX_NEW == max(map(len, expected))
    assert out.finish_reason == ["stop" if r[-1] in eos else "length" for r in expected]
    rows = [p for p in prompts for _ in range(4)]
    forced, _ = compute_log_probs(model, rows, out.response_ids, temperature=0.8, micro_batch_size=12,
                                  pad_id=tok.pad_token_id)
    for got, want in zip(out.rollout_logprobs, forced):
        assert torch.allclose(torch.tensor(got), torch.as_tensor(want), atol=1e-4)
    # Same seed, same samples; another seed, other samples.
    assert engine.generate(prompts, params).response_ids == out.response_ids
    other = SamplingParams(n=4, temperature=0.8, top_p=0.9, max_new_tokens=MAX_NEW, seed=8)
    assert engine.generate(prompts, other).response_ids != out.response_ids


def _five_prompts(tok):
    texts = ("Solve it. Calculate 3 + 4.", "Name a prime number larger than ten.", "Solve it. What is twelve minus five?",
             "Hi", "Write the alphabet backwards, starting at z, please.")
    return [tok(t)["input_ids"] for t in texts]


def test_continuous_batching_refills_slots_and_greedy_rows_equal_each_prompt_alone(model, tok):
    prompts = _five_prompts(tok)
    refs = [_plain_greedy(model, tok, p, MAX_NEW) for p in prompts]
    # Two extra "EOS" ids taken from early greedy tokens, so prompts end at different steps and
    # slots free up while other rows are still writing.
    stops = []
    for r in refs:
        t = next((t for t in r[1:6] if t not in stops and sum(t in o[:6] for o in refs) == 1), None)
        if t is not None and len(stops) < 2:
            stops.append(t)
    eos = [tok.eos_token_id] + stops
    expected = [_cut(r, eos) for r in refs]
    assert min(map(len, expected)) < MAX_NEW == max(map(len, expected))
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=MAX_NEW, seed=0)
    joined = HFRolloutEngine(model, pad_id=tok.pad_token_id, eos_ids=eos, micro_batch_size=4)
    alone = HFRolloutEngine(model, pad_id=tok.pad_token_id, eos_ids=eos, micro_batch_size=4,
                            continuous_batching=False)
    out, ref_out = joined.generate(prompts, params), alone.generate(prompts, params)
    for i, want in enumerate(expected):
        assert out.response_ids[2 * i] == out.response_ids[2 * i + 1] == want
    assert ref_out.response_ids == out.response_ids
    # Without refills, the groups of 2 prompts (4 rows) decode one after another: a group takes as
    # many steps as its longest response; by hand from the expected lengths (sorted by prompt length
    # as the engine admits them, minus the last token of each group, which needs no forward).
    order = sorted(range(len(prompts)), key=lambda i: (len(prompts[i]), i))
    groups = [order[k:k + 2] for k in range(0, len(order), 2)]
    assert ref_out.stats["decode_steps"] == sum(max(len(expected[i]) for i in g) - 1 for g in groups)
    # With refills the third prompt starts as soon as a prompt's two rows end: fewer, fuller steps.
    assert out.stats["decode_steps"] < ref_out.stats["decode_steps"]
    assert out.stats["decode_rows_mean"] > ref_out.stats["decode_rows_mean"]


def test_continuous_batching_samples_what_each_group_alone_samples_with_teacher_forced_logprobs(model, tok):
    prompts = _five_prompts(tok)
    params = SamplingParams(n=2, temperature=0.9, top_p=0.95, max_new_tokens=MAX_NEW, seed=11)
    first = HFRolloutEngine(model, pad_id=tok.pad_token_id, eos_ids=[tok.eos_token_id], micro_batch_size=4)
    full = first.generate(prompts, params)
    # Stop tokens picked from each prompt's first sample (at its 1st, 2nd or 3rd token): those rows
    # end early, at different steps, and free their slots while the second samples still write.
    eos = [tok.eos_token_id] + [full.response_ids[2 * i][i % 3] for i in range(len(prompts))]
    expected = [_cut(r, eos) for r in full.response_ids]
    assert min(map(len, expected)) < 4 and max(map(len, expected)) == MAX_NEW
    joined = HFRolloutEngine(model, pad_id=tok.pad_token_id, eos_ids=eos, micro_batch_size=4)
    alone = HFRolloutEngine(model, pad_id=tok.pad_token_id, eos_ids=eos, micro_batch_size=4, continuous_batching=False)
    out, ref = joined.generate(prompts, params), alone.generate(prompts, params)
    # Each row reads its own draws whenever it joins, so the schedule changes no sample.
    assert out.response_ids == ref.response_ids == expected
    assert out.stats["decode_steps"] < ref.stats["decode_steps"]
    rows = [p for p in prompts for _ in range(2)]
    forced, _ = compute_log_probs(model, rows, out.response_ids, temperature=0.9, micro_batch_size=10,
                                  pad_id=tok.pad_token_id)
    for got, want in zip(out.rollout_logprobs, forced):
        assert torch.allclose(torch.tensor(got), torch.as_tensor(want), atol=1e-4)
