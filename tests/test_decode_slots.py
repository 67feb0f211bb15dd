"""The HF engine's decode loop internals that only change speed: rows of one prompt split across
free slots, keys and values appended in place, bf16 weights packed for oneDNN. Each must leave the
sampled tokens and their log-probs as they were; the schedule is checked against a by-hand
simulation of the slots."""

import copy
from collections import deque
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.cache_utils import DynamicLayer

from trajflow.engines.batching import drop_leading_positions
from trajflow.engines.hf import HFRolloutEngine
from trajflow.engines.kv_cache import SlackLayer
from trajflow.modeling.forward import compute_log_probs
from trajflow.modeling.packed_linear import packing_available
from trajflow.stages.rollout import SamplingParams

MAX_NEW = 10


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _prompts(tok):
    texts = ("Solve it. Calculate 3 + 4.", "Name a prime number larger than ten.", "Solve it. What is twelve minus five?",
             "Hi", "Write the alphabet backwards, starting at z, please.")
    return [tok(t)["input_ids"] for t in texts]


def _cut(tokens, eos):
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[:i + 1]
    return tokens


def _simulated_steps(lengths_in_order, slots, n, split):
    """Decode forwards of a slot scheduler, by hand: each loop admits rows (any free slot: ``split``;
    else a prompt's remaining rows only when they all fit, one prompt into an empty batch), every
    live row writes a token, rows that wrote their last token leave, and the rest run one forward."""
    pending = deque(enumerate(lengths_in_order))   # (row, tokens to write), prompt-major
    live, steps = [], 0
    while pending or live:
        while pending and len(live) < slots:
            if not split:
                prompt = pending[0][0] // n
                k = sum(1 for r, _ in pending if r // n == prompt)
                if live and len(live) + k > slots:
                    break
                live.extend(pending.popleft()[1] for _ in range(k))
                continue
            live.append(pending.popleft()[1])
        live = [left - 1 for left in live if left > 1]
        steps += bool(live)
    return steps


def test_split_groups_fill_every_free_slot_with_the_same_samples(model, tok):
    prompts, n, slots = _prompts(tok), 3, 4
    params = SamplingParams(n=n, temperature=1.0, max_new_tokens=MAX_NEW, seed=5)
    first = HFRolloutEngine(model, pad_id=tok.pad_token_id, eos_ids=[tok.eos_token_id], micro_batch_size=slots)
    full = first.generate(prompts, params)
    # Stop tokens from early positions of some samples, so rows end at different steps.
    eos = [tok.eos_token_id] + [full.response_ids[n * i + i % n][1 + i % 3] for i in range(len(prompts))]
    expected = [_cut(r, eos) for r in full.response_ids]
    assert min(map(len, expected)) <= 3 and max(map(len, expected)) == MAX_NEW
    engines = {}
    for split in (False, True):
        engines[split] = HFRolloutEngine(model, pad_id=tok.pad_token_id, eos_ids=eos, micro_batch_size=slots)
        engines[split].split_groups = split
    whole, split = engines[False].generate(prompts, params), engines[True].generate(prompts, params)
    assert whole.response_ids == split.response_ids == expected
    rows = [p for p in prompts for _ in range(n)]
    forced, _ = compute_log_probs(model, rows, split.response_ids, temperature=1.0, micro_batch_size=15,
                                  pad_id=tok.pad_token_id)
    for got, want in zip(split.rollout_logprobs, forced):
        assert torch.allclose(torch.tensor(got), torch.as_tensor(want), atol=1e-4)
    # The engine admits prompts shortest first (ties by index), each prompt's samples in order.
    order = sorted(range(len(prompts)), key=lambda i: (len(prompts[i]), i))
    lengths = [len(expected[i * n + s]) for i in order for s in range(n)]
    assert whole.stats["decode_steps"] == _simulated_steps(lengths, slots, n, split=False)
    assert split.stats["decode_steps"] == _simulated_steps(lengths, slots, n, split=True)
    assert split.stats["decode_steps"] < whole.stats["decode_steps"]
    # Every row runs one forward per token but its last, whatever the schedule.
    forwards = sum(len(r) - 1 for r in expected)
    assert split.stats["decode_rows_mean"] * split.stats["decode_steps"] == pytest.approx(forwards)


def test_slack_layer_appends_in_place_and_equals_concatenation():
    g = torch.Generator().manual_seed(0)
    kv = lambda rows, seq: (torch.randn(rows, 2, seq, 4, generator=g), torch.randn(rows, 2, seq, 4, generator=g))  # noqa: E731
    ref, mine = DynamicLayer(), DynamicLayer()
    first = kv(3, 5)
    ref.update(*first)
    mine.update(*first)
    mine.__class__, mine.slack = SlackLayer, 4
    buffers = []  # each distinct buffer, kept alive so that identity means no new allocation
    rows = 3
    for step in range(9):
        new = kv(rows, 1)
        want_k, want_v = ref.update(*new)
        got_k, got_v = mine.update(*new)
        assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
        if not any(b is mine._kbuf for b in buffers):
            buffers.append(mine._kbuf)
        if step == 3:  # rows leave; leading columns become padding for all
            idx, rows = torch.tensor([0, 2]), 2
            ref.batch_select_indices(idx)
            mine.batch_select_indices(idx)
            drop_leading_positions(SimpleNamespace(layers=[ref, mine]), 2)
            assert torch.equal(mine.keys, ref.keys) and torch.equal(mine.values, ref.values)
    # 9 appended columns with room for 4: a buffer at the first append (5 + 1 + 4 positions), the row
    # selection's copy (the dropped columns stay a view), one more when the room ran out at the 6th
    # append; the 6 other appends write in place.
    assert len(buffers) == 3
    assert mine.keys.shape == ref.keys.shape == (2, 2, 12, 4)


@pytest.mark.skipif(not packing_available(torch.bfloat16, "cpu"), reason="no oneDNN bf16 kernel on this CPU")
def test_packed_bf16_copy_samples_what_the_plain_copy_samples(model, tok):
    prompts = _prompts(tok)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=MAX_NEW, seed=3)
    plain = HFRolloutEngine(model, pad_id=tok.pad_token_id, eos_ids=[tok.eos_token_id], micro_batch_size=4,
                            dtype="bfloat16")
    plain.pack_weights = False
    plain._unpack(restore=True)
    packed = HFRolloutEngine(model, pad_id=tok.pad_token_id, eos_ids=[tok.eos_token_id], micro_batch_size=4,
                             dtype="bfloat16")
    linears = [m for m in packed.model.modules() if type(m) is torch.nn.Linear]
    assert linears and all(hasattr(m, "_trajflow_packed_weight") for m in linears)
    untied = [m for m in linears if m is not packed.model.get_output_embeddings()]
    assert all(m.weight.numel() == 0 for m in untied)  # no second copy of the weights
    want = plain.generate(prompts, params)
    got = packed.generate(prompts, params)
    assert got.response_ids == want.response_ids
    assert got.rollout_logprobs == want.rollout_logprobs  # bit for bit
    # Release (the update phase) and sync again: packed again, the same samples.
    packed.release()
    assert all(not hasattr(m, "_trajflow_packed_weight") for m in linears)
    packed.sync()
    assert packed.generate(prompts, params).response_ids == want.response_ids
    # A full weight load unpacks exactly (the packed copy read back) and packs the new weights.
    state = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    packed.update_weights(state)
    assert packed.generate(prompts, params).rollout_logprobs == want.rollout_logprobs
    packed._unpack(restore=True)
    for name, value in packed.model.state_dict().items():
        assert torch.equal(value, state[name]), name


def test_lean_decode_step_samples_what_the_model_forward_samples(model, tok):
    """fp32: the same tokens as the model's own forward, and log-probs within float rounding of the
    teacher-forced ones; one step's hidden state equals the model's to rounding."""
    from trajflow.engines.decode_step import decode_step, supports_decode_step
    from trajflow.modeling.compat import cache_kwargs, output_cache

    assert supports_decode_step(model) is None
    prompts = _prompts(tok)
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=MAX_NEW, seed=11)
    out = {}
    for lean in (False, True):
        engine = HFRolloutEngine(model, pad_id=tok.pad_token_id, eos_ids=[tok.eos_token_id], micro_batch_size=4)
        engine.lean_step = lean
        out[lean] = engine.generate(prompts, params)
    assert out[True].response_ids == out[False].response_ids
    assert out[True].stats == out[False].stats
    diff = max(abs(a - b) for x, y in zip(out[True].rollout_logprobs, out[False].rollout_logprobs) for a, b in zip(x, y))
    assert diff < 1e-4
    # One step by hand on a left-padded batch: the padded row's masked columns change nothing.
    ids = torch.tensor([[5, 6, 7, 8], [0, 0, 9, 10]])
    attn = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]])
    pos = torch.tensor([[0, 1, 2, 3], [0, 0, 0, 1]])
    caches = [output_cache(model.get_decoder()(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True))
              for _ in range(2)]
    tok_next, attn_next, pos_next = torch.tensor([[11], [12]]), torch.cat([attn, torch.ones(2, 1, dtype=torch.long)], 1), \
        torch.tensor([[4], [2]])
    want = model.get_decoder()(input_ids=tok_next, attention_mask=attn_next, position_ids=pos_next,
                               **cache_kwargs(caches[0]), use_cache=True).last_hidden_state[:, -1]
    got = decode_step(model.get_decoder(), tok_next, attn_next, pos_next, caches[1])
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
    assert caches[1].layers[0].keys.shape[2] == caches[0].layers[0].keys.shape[2] == 5
    for a, b in zip(caches[0].layers, caches[1].layers):
        assert torch.allclose(a.keys, b.keys) and torch.allclose(a.values, b.values)


def test_lean_decode_step_refuses_what_it_does_not_compute(model):
    from trajflow.engines.decode_step import supports_decode_step

    cfg = copy.deepcopy(model.config)
    other = SimpleNamespace(config=cfg)
    cfg.model_type = "gemma3_text"
    assert "model_type" in supports_decode_step(other)
    cfg.model_type, cfg.sliding_window, cfg.use_sliding_window = "mistral", 4096, True
    assert supports_decode_step(other) == "sliding-window attention"


def test_ended_rows_places_taken_by_the_next_rows_sample_the_same(model, tok, monkeypatch):
    """reuse_slots: the next rows written into ended rows' places in the cache (no whole-cache copy)
    sample the same tokens with the same schedule as dropping the ended rows and joining the new."""
    import trajflow.engines.batching as batching

    filled = []
    real_fill = batching._fill_rows
    monkeypatch.setattr(batching, "_fill_rows", lambda *a: (filled.append(a[3]), real_fill(*a)))
    prompts, n, slots = _prompts(tok), 3, 4
    params = SamplingParams(n=n, temperature=1.0, max_new_tokens=MAX_NEW, seed=5)
    first = HFRolloutEngine(model, pad_id=tok.pad_token_id, eos_ids=[tok.eos_token_id], micro_batch_size=slots)
    full = first.generate(prompts, params)
    eos = [tok.eos_token_id] + [full.response_ids[n * i + i % n][1 + i % 3] for i in range(len(prompts))]
    out = {}
    for reuse in (False, True):
        engine = HFRolloutEngine(model, pad_id=tok.pad_token_id, eos_ids=eos, micro_batch_size=slots)
        engine.reuse_slots = reuse
        filled.clear()
        out[reuse] = engine.generate(prompts, params)
        assert bool(filled) == reuse
    assert out[True].response_ids == out[False].response_ids
    assert out[True].stats == out[False].stats
    diff = max(abs(a - b) for x, y in zip(out[True].rollout_logprobs, out[False].rollout_logprobs) for a, b in zip(x, y))
    assert diff < 1e-4
    rows = [p for p in prompts for _ in range(n)]
    forced, _ = compute_log_probs(model, rows, out[True].response_ids, temperature=1.0, micro_batch_size=15,
                                  pad_id=tok.pad_token_id)
    for got, want in zip(out[True].rollout_logprobs, forced):
        assert torch.allclose(torch.tensor(got), torch.as_tensor(want), atol=1e-4)
