"""Multi-turn token-in/token-out episodes over the real vLLM engine, and LoRA adapters served by vLLM
(a ``LoRARequest``, never merged) after an update."""

from __future__ import annotations

from collections import Counter

import torch

from trajflow.stages.rollout import SamplingParams
from tests.vllm.test_engine import BF16_MAX, BF16_MEAN, PROMPTS, teacher_forced
from trajflow.engines.episodes import EpisodeLimits, run_episodes
from trajflow.envs.registry import ENVIRONMENTS, EnvContext, Environment, StepResult, make_environment
from trajflow.envs.render import ChatRenderer

ROW = {"messages": [{"role": "user", "content": "Say 1."}], "ground_truth": "1",
       "data_source": "reasoning_gym/basic_arithmetic", "extra_info": {}, "prompt_id": "0"}


class GoOnVLLM(Environment):
    """Never done: answers every assistant message with the user message "go on"."""

    def step(self, message: dict) -> StepResult:
        return StepResult(observations=[{"role": "user", "content": "go on"}])


@ENVIRONMENTS.register("test_go_on_vllm")
def _go_on(ctx: EnvContext) -> GoOnVLLM:
    return GoOnVLLM()


def test_multi_turn_episodes_keep_sampled_tokens_masks_and_logprobs(engine, hf_model, tok):
    eos = tok.eos_token_id
    renderer = ChatRenderer(tok, [], [eos])
    rows = [{**ROW, "messages": [{"role": "user", "content": f"Say {k}."}]} for k in range(4)]
    # The random model rarely samples <|im_end|>: let the engine also stop on its three most frequent
    # tokens so turns end with "stop" and the loop appends observations (the closing then includes
    # <|im_end|>, which the model did not write: the renderer's ended_with_eos=False case).
    probe = engine.generate([renderer.prompt_ids(r["messages"]) for r in rows],
                            SamplingParams(n=4, temperature=1.0, max_new_tokens=24, seed=0))
    frequent = [t for t, _ in Counter(t for ids in probe.response_ids for t in ids).most_common(3)]
    saved = engine.eos_ids
    engine.eos_ids = saved + frequent
    try:
        envs = [make_environment("test_go_on_vllm", EnvContext([], None)) for _ in rows]
        eps = run_episodes(engine, renderer, envs, rows, SamplingParams(temperature=1.0, seed=3),
                           EpisodeLimits(total_tokens=160, turn_tokens=24, max_assistant_turns=3, max_user_turns=3),
                           [eos])
    finally:
        engine.eos_ids = saved
    closing = tok("<|im_end|>", add_special_tokens=False)["input_ids"]
    obs = tok("\n<|im_start|>user\ngo on<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    multi, diffs = 0, []
    for ep in eps:
        assert ep.finish_reason in ("max_turns", "length")
        assert len(ep.response_ids) == len(ep.loss_mask) == len(ep.rollout_logprobs) <= 160
        spans = list(zip(ep.turn_spans[::2], ep.turn_spans[1::2]))
        multi += len(spans) > 1
        for (a, b), nxt in zip(spans, spans[1:] + [(len(ep.response_ids), None)]):
            turn = ep.response_ids[a:b]
            assert ep.loss_mask[a:b] == [1] * (b - a) and b - a <= 24
            if nxt[1] is not None:  # the prefix property: model tokens kept, then exactly the template's tokens
                expect = (obs if turn[-1] == eos else closing + obs)
                assert ep.response_ids[b:nxt[0]] == expect and turn[-1] in [eos] + frequent
            assert ep.loss_mask[b:nxt[0]] == [0] * (nxt[0] - b)
        # The engine's log-probs at the model's tokens equal teacher-forced ones over the whole sequence.
        tf = teacher_forced(hf_model, ep.prompt_ids, ep.response_ids, 1.0)
        mask = torch.tensor(ep.loss_mask, dtype=torch.bool)
        diffs.append((tf[mask] - torch.tensor(ep.rollout_logprobs)[mask]).abs())
        assert all(lp == 0.0 for lp, m in zip(ep.rollout_logprobs, ep.loss_mask) if m == 0)
    d = torch.cat(diffs)
    assert d.mean() < BF16_MEAN and d.max() < BF16_MAX, (d.mean(), d.max())
    assert multi >= 2  # the check covered tokens after an observation


def test_lora_adapter_sync_without_merging(lora_engine, vllm_model_dir):
    from transformers import AutoModelForCausalLM

    from trajflow.config import ModelConfig
    from trajflow.modeling import lora

    base = AutoModelForCausalLM.from_pretrained(vllm_model_dir, dtype="float32").eval()
    prompt, cont = PROMPTS[1], [28, 253, 1789, 30, 216, 2683]
    old = teacher_forced(base, prompt, cont, 1.0)
    model = lora.apply_lora(base, ModelConfig(lora_rank=8, lora_alpha=16.0))
    torch.manual_seed(1)
    with torch.no_grad():  # an "update": B away from 0 on every adapter, so the adapter changes the model
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.05)
    model.eval()
    new = teacher_forced(model, prompt, cont, 1.0)
    assert (new - old).abs().mean() > 0.5
    before = torch.tensor(_score(lora_engine, prompt, cont))
    assert (before - old).abs().max() < BF16_MAX  # no adapter yet: the base model
    lora_engine.update_adapter(lora.adapter_state(model), model.peft_config[lora.ADAPTER], version=1)
    after = torch.tensor(_score(lora_engine, prompt, cont))
    assert (after - new).abs().mean() < BF16_MEAN and (after - new).abs().max() < BF16_MAX, (after, new)
    out = lora_engine.generate([prompt], SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=3))
    for ids, lps in zip(out.response_ids, out.rollout_logprobs):
        assert torch.allclose(torch.tensor(lps), teacher_forced(model, prompt, ids, 1.0), atol=BF16_MAX)
    # A second version replaces the first (a new LoRA id; the base weights in vLLM never change).
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.zero_()
    lora_engine.update_adapter(lora.adapter_state(model), model.peft_config[lora.ADAPTER], version=2)
    assert (torch.tensor(_score(lora_engine, prompt, cont)) - old).abs().max() < BF16_MAX


def _score(engine, prompt, continuation):
    from vllm import SamplingParams as VSamplingParams

    kw = {"lora_request": engine.lora_request} if engine.lora_request is not None else {}
    (req,) = engine.llm.generate([{"prompt_token_ids": prompt + continuation}],
                                 VSamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0), use_tqdm=False,
                                 **kw)
    return [float(step[t].logprob) for step, t in zip(req.prompt_logprobs[len(prompt):], continuation)]


def test_rslora_adapter_is_scaled_by_alpha_over_sqrt_rank_in_vllm(lora_engine, vllm_model_dir):
    """model.lora_use_rslora: the adapter_config.json the engine writes carries use_rslora, and vLLM scales
    the adapter by alpha / sqrt(r) = 16 / sqrt(8) (Kalajdzievski 2023), as peft does in training, not by
    plain LoRA's alpha / r = 2: vLLM's log-probs match the rsLoRA model and not the same tensors at alpha / r."""
    from transformers import AutoModelForCausalLM

    from trajflow.config import ModelConfig
    from trajflow.modeling import lora

    prompt, cont = PROMPTS[1], [28, 253, 1789, 30, 216, 2683]
    models = {}
    for rs in (True, False):
        base = AutoModelForCausalLM.from_pretrained(vllm_model_dir, dtype="float32").eval()
        m = lora.apply_lora(base, ModelConfig(lora_rank=8, lora_alpha=16.0, lora_use_rslora=rs))
        torch.manual_seed(1)
        with torch.no_grad():
            for name, p in m.named_parameters():
                if "lora_B" in name:
                    p.normal_(0.0, 0.03)
        models[rs] = m.eval()
    rs_lp = teacher_forced(models[True], prompt, cont, 1.0)
    plain_lp = teacher_forced(models[False], prompt, cont, 1.0)
    assert (rs_lp - plain_lp).abs().mean() > BF16_MEAN  # the two scales differ by more than bf16 noise
    lora_engine.update_adapter(lora.adapter_state(models[True]), models[True].peft_config[lora.ADAPTER], version=11)
    served = torch.tensor(_score(lora_engine, prompt, cont))
    assert (served - rs_lp).abs().mean() < BF16_MEAN and (served - rs_lp).abs().max() < BF16_MAX, (served, rs_lp)
    # not plain LoRA's alpha / r: vLLM's log-probs are several times closer to the rsLoRA model's
    assert (served - plain_lp).abs().mean() > 3 * (served - rs_lp).abs().mean(), (served, rs_lp, plain_lp)
