"""Shared-prompt forward and prefill: the same log-probs, entropies, gradients and greedy tokens as
computing every row's prompt on its own (issue 9: identical results with and without the
optimisation on a fixed batch, within float tolerance)."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from trajflow.stages.rollout import SamplingParams
from trajflow.engines.hf import HFRolloutEngine
from trajflow.modeling.forward import (forward_micro_batch, layout_prompts, length_buckets, shared_prompt_rows,
                                      uses_tree_packing)
from trajflow.modeling.packing import pack
from trajflow.modeling.tree import tree_pack, tree_packed_tokens

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


def test_layout_prompts_by_hand():
    # Common prefix [5, 6] (not [5, 6, 7]: the shortest prompt keeps one suffix token).
    lay = layout_prompts([[5, 6, 7], [5, 6, 8, 9], [5, 6, 7, 1, 2]], PAD)
    assert lay.common == 2
    assert lay.input_ids.tolist() == [[5, 6, PAD, PAD, 7], [5, 6, PAD, 8, 9], [5, 6, 7, 1, 2]]
    assert lay.attention_mask.tolist() == [[1, 1, 0, 0, 1], [1, 1, 0, 1, 1], [1, 1, 1, 1, 1]]
    assert lay.position_ids.tolist() == [[0, 1, 1, 1, 2], [0, 1, 1, 2, 3], [0, 1, 2, 3, 4]]
    assert layout_prompts([[5, 6, 7]], PAD).common == 0  # one prompt: nothing to share
    assert layout_prompts([[5, 6], [7, 6]], PAD).common == 0


def test_tree_pack_by_hand():
    # Rows 0 and 1 share prompt A = [5, 6, 7], row 2 has B = [5, 6, 8, 9]: common prefix [5, 6].
    packed = pack([[5, 6, 7], [5, 6, 7], [5, 6, 8, 9]], [[20, 21, 22], [30], [40, 41]], PAD)
    tree = tree_pack(packed)
    # prefix 5 6 | A's rest 7, row 0's inputs 20 21 (row 1 has none) | B's rest 8 9, row 2's input 40
    assert tree.input_ids.tolist() == [[5, 6, 7, 20, 21, 8, 9, 40]]
    # Positions are each token's place in its own row prompt + response.
    assert tree.position_ids.tolist() == [[0, 1, 2, 3, 4, 2, 3, 4]]
    assert tree.attention_mask.shape == (1, 1, 8, 8) and tree.attention_mask.dtype == torch.bool
    assert tree.attention_mask[0, 0].int().tolist() == [
        [1, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0, 0],  # A's 7 sees the prefix
        [1, 1, 1, 1, 0, 0, 0, 0],  # row 0's 20 sees prefix + A
        [1, 1, 1, 1, 1, 0, 0, 0],
        [1, 1, 0, 0, 0, 1, 0, 0],  # B's 8 sees the prefix, not A or row 0
        [1, 1, 0, 0, 0, 1, 1, 0],
        [1, 1, 0, 0, 0, 1, 1, 1],  # row 2's 40 sees prefix + B
    ]
    # Row 0's tokens 20 21 22 are predicted at A's last token (2), then at 20 (3) and 21 (4); row 1's 30
    # at A's last token; row 2's 40 41 at B's last token (6) and at 40 (7).
    assert tree.source.tolist() == [2, 3, 4, 2, 6, 7]
    assert tree_packed_tokens(packed) == tree.num_tokens == 8
    # Attention blocks: each prompt's rest with its responses, against the prefix's keys and its own.
    assert tree.common == 2 and tree.blocks == ((2, 5), (5, 8))
    causal_after_prefix = [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    assert [m[0, 0].int().tolist() for m in tree.block_masks] == [causal_after_prefix, causal_after_prefix]
    # One prompt: no prefix segment, every row's response sees the whole prompt.
    one = tree_pack(pack([[5, 6]], [[7, 8]], PAD))
    assert one.input_ids.tolist() == [[5, 6, 7]] and one.position_ids.tolist() == [[0, 1, 2]]
    assert one.attention_mask[0, 0].int().tolist() == [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
    assert one.source.tolist() == [1, 2]
    assert one.common == 0 and one.blocks == ((0, 3),)
    assert one.block_masks[0][0, 0].int().tolist() == [[1, 0, 0], [1, 1, 0], [1, 1, 1]]


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32)


def _batch(vocab: int, common: int = 0):
    g = torch.Generator().manual_seed(3)

    def toks(k):
        return torch.randint(10, vocab, (k,), generator=g).tolist()

    head = toks(common)  # a template's shared beginning (system prompt, worked example)
    p1, p2, p3 = head + toks(9), head + toks(4), head + toks(12)
    # 3 distinct prompts of different lengths, groups of 3, 2 and 1, responses of lengths 1..7.
    prompts = [p1, p1, p1, p2, p2, p3]
    responses = [toks(5), toks(1), toks(7), toks(3), toks(6), toks(2)]
    return pack(prompts, responses, PAD)


def test_length_buckets_by_hand():
    # Lengths 10, 2, 3, 9 with a bucket costing 4: {2, 3} + {9, 10} costs 2*3 + 4 + 2*10 + 4 = 34;
    # one bucket 4*10 + 4 = 44, all apart 2+3+9+10 + 16 = 40, {2},{3},{9,10} 37, {2,3},{9},{10} 37.
    assert length_buckets([10, 2, 3, 9], overhead=4) == [[1, 2], [3, 0]]
    assert length_buckets([10, 2, 3, 9], overhead=100) == [[1, 2, 3, 0]]
    assert length_buckets([10, 2, 3, 9], overhead=0) == [[1], [2], [3], [0]]
    assert length_buckets([4, 4, 4], overhead=0) == [[0, 1, 2]]
    assert length_buckets([], overhead=4) == []


# overhead 0: one response bucket per distinct length, a one-token response in none; 1000: one bucket.
# tree_max 0 forces the cached-prompt (bucket) path; 2048 takes the tree-packed one.
@pytest.mark.parametrize("train_mode,common,overhead,tree_max",
                         [(False, 0, 8, 0), (True, 0, 8, 0), (False, 6, 8, 0), (True, 6, 8, 0),
                          (True, 6, 0, 0), (True, 0, 0, 0), (True, 6, 1000, 0),
                          (False, 0, 8, 2048), (True, 0, 8, 2048), (False, 6, 8, 2048), (True, 6, 8, 2048)])
def test_shared_forward_matches_the_full_forward(model, train_mode, common, overhead, tree_max):
    packed = _batch(model.config.vocab_size, common)
    assert uses_tree_packing(model, packed, True, tree_max) == (tree_max > 0)
    model.train(train_mode)
    results = {}
    for share in (False, True):
        model.zero_grad()
        logp, ent = forward_micro_batch(model, packed, 0.7, compute_entropy=True, share_prompts=share,
                                        entropy_grad=True, bucket_overhead=overhead, tree_max_tokens=tree_max)
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


def test_entropy_gradient_only_when_asked_and_equal_to_the_plain_formula(model):
    packed = _batch(model.config.vocab_size, 4)
    model.train(False)
    m = packed.response_mask
    P, T = packed.prompt_width, packed.responses.shape[1]
    # Reference: full logits of a plain forward at the positions that predict the responses, and
    # H = -sum_v p_v log p_v with p = softmax(z / T_s).
    model.zero_grad()
    z = model(input_ids=packed.input_ids, attention_mask=packed.attention_mask,
              position_ids=packed.position_ids).logits[:, P - 1:P - 1 + T] / 0.7
    logp_all = torch.log_softmax(z, dim=-1)
    h_ref = -(logp_all.exp() * logp_all).sum(-1)
    (h_ref * m).sum().backward()
    g_ref = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    _, ent = forward_micro_batch(model, packed, 0.7, compute_entropy=True, entropy_grad=True)
    assert torch.allclose(ent * m, h_ref.detach() * m, atol=1e-5)
    (ent * m).sum().backward()
    for k, g in g_ref.items():
        assert torch.allclose(model.get_parameter(k).grad, g, atol=1e-6, rtol=1e-4), k
    model.zero_grad()
    # Without entropy_grad: the same values, as a metric with no graph behind it.
    logp, ent = forward_micro_batch(model, packed, 0.7, compute_entropy=True)
    assert logp.requires_grad and not ent.requires_grad
    assert torch.allclose(ent * m, h_ref.detach() * m, atol=1e-5)


@pytest.mark.parametrize("chunk", [1, 3, 1024])
def test_lm_head_chunks_give_the_plain_log_probs_and_gradients(model, chunk):
    """Response positions go through the LM head ``logits_chunk`` at a time: any chunking gives the
    plain formula's values, ``log p_y = log_softmax(z / T)_y`` from the model's own full forward, and
    its gradients."""
    packed = _batch(model.config.vocab_size, 4)
    model.train(False)
    m = packed.response_mask
    P, T = packed.prompt_width, packed.responses.shape[1]
    assert int(m.sum()) > 3  # several chunks of 3
    model.zero_grad()
    z = model(input_ids=packed.input_ids, attention_mask=packed.attention_mask,
              position_ids=packed.position_ids).logits[:, P - 1:P - 1 + T] / 0.7
    lp_ref = torch.log_softmax(z, dim=-1).gather(-1, packed.responses[..., None]).squeeze(-1)
    (lp_ref * m).sum().backward()
    g_ref = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    logp, _ = forward_micro_batch(model, packed, 0.7, logits_chunk=chunk)
    assert torch.allclose(logp * m, lp_ref.detach() * m, atol=1e-5)
    (logp * m).sum().backward()
    for k, g in g_ref.items():  # float32 rounding only (a 1-row chunk is a matrix-vector product)
        scale = g.abs().max().item()
        assert (model.get_parameter(k).grad - g).abs().max().item() <= 1e-4 * scale + 1e-7, k
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
    # A shared beginning, as a chat template with one system prompt gives.
    prompts = [tok("Solve it. Calculate 3 + 4.")["input_ids"], tok("Solve it. What is twelve minus five?")["input_ids"]]
    engine = HFRolloutEngine(model, pad_id=tok.pad_token_id, eos_ids=[tok.eos_token_id], micro_batch_size=8)
    # Both prompts in one call, n = 3: common prefix once, each prompt once, cache copied to 3 rows.
    shared = engine.generate(prompts, SamplingParams(n=3, temperature=0.0, max_new_tokens=8, seed=0))
    assert len(shared.response_ids) == 6
    for i, p in enumerate(prompts):
        # Reference: plain generate on this prompt alone, no cache handed in.
        ids = torch.tensor([p])
        ref = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                             eos_token_id=[tok.eos_token_id], pad_token_id=tok.pad_token_id)[0, len(p):].tolist()
        if tok.eos_token_id in ref:
            ref = ref[:ref.index(tok.eos_token_id) + 1]
        for s in range(3):
            assert shared.response_ids[i * 3 + s] == ref


def test_tree_forward_under_gradient_checkpointing(tiny_model_dir):
    # The checkpointed layers recompute in the backward, outside the tree forward's call: it then runs
    # SDPA with the dense tree mask both times (the recomputation must save what the forward saved).
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    packed = _batch(model.config.vocab_size, 6)
    assert uses_tree_packing(model, packed)
    m = packed.response_mask
    results = {}
    for share in (False, True):
        model.zero_grad()
        logp, _ = forward_micro_batch(model, packed, 0.7, share_prompts=share)
        (-(logp * m).sum() / m.sum()).backward()
        results[share] = (logp.detach() * m, {k: p.grad.clone() for k, p in model.named_parameters()
                                              if p.grad is not None})
    assert torch.allclose(results[False][0], results[True][0], atol=1e-5, rtol=1e-5)
    assert results[False][1].keys() == results[True][1].keys()
    for k, g in results[False][1].items():
        assert torch.allclose(results[True][1][k], g, atol=1e-6, rtol=1e-4), k
    assert model.config._attn_implementation == "sdpa"  # restored after the tree forward
