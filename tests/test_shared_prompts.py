"""Shared-prompt forward and prefill: the same log-probs, entropies, gradients and greedy tokens as
computing every row's prompt on its own (issue 9: identical results with and without the
optimisation on a fixed batch, within float tolerance)."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from stages.rollout import SamplingParams
from trajflow.engines.hf import HFRolloutEngine
from trajflow.workers.forward import forward_micro_batch, pack, shared_prompt_rows

PAD = 2


def test_shared_prompt_rows_by_hand():
    # Rows 0, 2, 3 share prompt [5, 6]; row 1 is [7]; row 4 is [PAD, 6] (a real pad-id token, not padding).
    prompts = [[5, 6], [7], [5, 6], [5, 6], [PAD, 6]]
    packed = pack(prompts, [[1]] * 5, PAD)
    first, inverse = shared_prompt_rows(packed)
    groups = {}
    for row, g in enumerate(inverse.tolist()):
        groups.setdefault(g, []).append(row)
    assert sorted(groups.values()) == [[0, 2, 3], [1], [4]]
    assert sorted(first.tolist()) == [0, 1, 4]
    for g, rows in groups.items():
        assert first[g].item() == rows[0]
    assert shared_prompt_rows(pack([[5, 6], [7]], [[1], [1]], PAD)) is None


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32)


def _batch(vocab: int):
    g = torch.Generator().manual_seed(3)

    def toks(k):
        return torch.randint(10, vocab, (k,), generator=g).tolist()

    p1, p2, p3 = toks(9), toks(4), toks(12)
    # 3 distinct prompts of different lengths, groups of 3, 2 and 1, responses of lengths 1..7.
    prompts = [p1, p1, p1, p2, p2, p3]
    responses = [toks(5), toks(1), toks(7), toks(3), toks(6), toks(2)]
    return pack(prompts, responses, PAD)


@pytest.mark.parametrize("train_mode", [False, True])
def test_shared_forward_matches_the_full_forward(model, train_mode):
    packed = _batch(model.config.vocab_size)
    model.train(train_mode)
    results = {}
    for share in (False, True):
        model.zero_grad()
        logp, ent = forward_micro_batch(model, packed, 0.7, compute_entropy=True, share_prompts=share)
        m = packed.response_mask
        loss = -(logp * m).sum() / m.sum() - 0.1 * (ent * m).sum() / m.sum()
        loss.backward()
        grads = {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None}
        results[share] = (logp.detach() * m, ent.detach() * m, loss.item(), grads)
    (lp0, e0, l0, g0), (lp1, e1, l1, g1) = results[False], results[True]
    assert torch.allclose(lp0, lp1, atol=1e-5, rtol=1e-5)
    assert torch.allclose(e0, e1, atol=1e-5, rtol=1e-5)
    assert l0 == pytest.approx(l1, rel=1e-5, abs=1e-6)
    assert g0.keys() == g1.keys() and len(g0) > 0
    for k in g0:  # the embedding's gradient includes the prompt tokens' share: the cache copy sums it
        assert torch.allclose(g0[k], g1[k], atol=1e-6, rtol=1e-4), k
    model.zero_grad()


def test_shared_forward_with_one_token_responses(model):
    packed = pack([[11, 12, 13], [11, 12, 13]], [[40], [41]], PAD)
    model.eval()
    with torch.no_grad():
        a, _ = forward_micro_batch(model, packed, 1.0, share_prompts=False)
        b, _ = forward_micro_batch(model, packed, 1.0, share_prompts=True)
    assert a.shape == b.shape == (2, 1)
    assert torch.allclose(a, b, atol=1e-5)


def test_prefilled_greedy_generation_equals_single_prompt_generation(model, tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompts = [tok("Calculate 3 + 4.")["input_ids"], tok("What is twelve minus five, please?")["input_ids"]]
    engine = HFRolloutEngine(model, pad_id=tok.pad_token_id, eos_ids=[tok.eos_token_id], micro_batch_size=8)
    # n = 3 takes the prefill path (prompt computed once, cache copied); n = 1 does not.
    shared = engine.generate(prompts, SamplingParams(n=3, temperature=0.0, max_new_tokens=8, seed=0))
    alone = engine.generate(prompts, SamplingParams(n=1, temperature=0.0, max_new_tokens=8, seed=0))
    assert len(shared.response_ids) == 6
    for i in range(2):
        for s in range(3):
            assert shared.response_ids[i * 3 + s] == alone.response_ids[i]
            assert shared.finish_reason[i * 3 + s] == alone.finish_reason[i]
