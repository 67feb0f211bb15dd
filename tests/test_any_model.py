"""Parity matrix: every supported architecture, every fast path, against transformers' own code.

Tiny random-weight models (2 layers, hidden 64, vocab 512) built from transformers' own config
classes, with a sliding window of 8 where the architecture has one, so that prompt + response
(up to ~30 tokens) runs past it. 16 rows: 4 prompts x 4 samples sharing a 10-token prefix. The
expectations are transformers' own: a plain forward of each ``[prompt | response]`` row alone
(log-probs at temperature 0.7, gradients of their sum) and ``model.generate`` on each prompt alone
(greedy tokens). Paths: the tree-packed forward, the cached-prompt forward, token-budget
micro-batches (``compute_log_probs`` and the update's packing) and the HF engine's decode loop (its
shared-prompt prefill, continuous batching over 4 slots, greedy tokens and sampled tokens' log-probs).

``python tests/test_any_model.py`` prints the matrix.
"""

from __future__ import annotations

import logging

import pytest
import torch
import transformers as tf

from trajflow.stages.rollout import SamplingParams
from trajflow.engines.hf import HFRolloutEngine
from trajflow.modeling.lean_mlp import lean_mlp
from trajflow.modeling.lean_norm import lean_norm
from trajflow.modeling.forward import compute_log_probs, forward_micro_batch, uses_tree_packing
from trajflow.modeling.packing import micro_batch_plan, pack

VOCAB, PAD, EOS, WINDOW, TEMP = 512, 0, 2, 8, 0.7
LP_TOL, GRAD_TOL = 1e-4, 1e-3
_BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, pad_token_id=PAD, bos_token_id=1, eos_token_id=EOS)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)


def _configs() -> dict:
    """One tiny config per architecture; a sliding window of 8 wherever the architecture has one
    (on one of the two layers where it declares per-layer types)."""
    sw = dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)
    return {
        "llama": tf.LlamaConfig(**_BASE),
        "qwen2": tf.Qwen2Config(**_BASE, **sw),
        "qwen3": tf.Qwen3Config(**_BASE, head_dim=16, **sw),
        "qwen2_moe": tf.Qwen2MoeConfig(**_BASE, **_MOE, shared_expert_intermediate_size=32, **sw),
        "qwen3_moe": tf.Qwen3MoeConfig(**_BASE, **_MOE, head_dim=16, use_sliding_window=True,
                                       sliding_window=WINDOW),
        "mistral": tf.MistralConfig(**_BASE, sliding_window=WINDOW),
        # Gemma 2: eager attention (its default; SDPA cannot soft-cap), attention and final-logit
        # soft-capping, query_pre_attn_scalar scaling, alternating sliding / full layers.
        "gemma2": tf.Gemma2Config(**_BASE, head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=24,
                                  attn_logit_softcapping=5.0, final_logit_softcapping=3.0),
        "gemma3": tf.Gemma3TextConfig(**_BASE, head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=24,
                                      layer_types=["sliding_attention", "full_attention"],
                                      final_logit_softcapping=3.0),
        "phi3": tf.Phi3Config(**_BASE, sliding_window=WINDOW),
        "olmo2": tf.Olmo2Config(**_BASE),
        "gpt_neox": tf.GPTNeoXConfig(**{k: v for k, v in _BASE.items() if k != "num_key_value_heads"}),
    }


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    # The models are tiny: a second intra-op thread only adds synchronisation (15x slower decoding
    # on two busy cores).
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


ARCHS = list(_configs())
PATHS = ["tree", "cached", "budget", "decode"]
_models: dict = {}
_refs: dict = {}


def _build(arch: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(_configs()[arch]).eval()
    # Scale the random weights up so the soft-caps and windows change the outputs visibly.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(2.0)
    return model


def _model(arch: str) -> torch.nn.Module:
    if arch not in _models:
        _models[arch] = _build(arch)
    return _models[arch]


def _rows():
    g = torch.Generator().manual_seed(1)

    def toks(k):
        return torch.randint(3, VOCAB, (k,), generator=g).tolist()

    head = toks(10)
    prompts = [head + toks(k) for k in (2, 4, 3, 5)]
    rows, responses = [], []
    for i, p in enumerate(prompts):
        for s in range(4):
            rows.append(p)
            responses.append(toks(3 + (5 * i + 3 * s) % 13))  # 3 .. 15 tokens: up to 30 in all
    return prompts, rows, responses


def _grads(model) -> dict:
    return {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None}


def _reference(arch: str):
    """transformers' own forward of each row alone: per-token log-probs and the gradient of their sum."""
    if arch not in _refs:
        model = _model(arch)
        _, rows, responses = _rows()
        model.zero_grad()
        lps = []
        for p, r in zip(rows, responses):
            ids = torch.tensor([p + r])
            z = model(input_ids=ids).logits[0, len(p) - 1:len(p) + len(r) - 1].float() / TEMP
            lp = torch.log_softmax(z, -1).gather(-1, torch.tensor(r)[:, None])[:, 0]
            lp.sum().backward()
            lps.append(lp.detach())
        _refs[arch] = (lps, _grads(model))
        model.zero_grad()
    return _refs[arch]


def _grad_rel(got: dict, want: dict) -> float:
    assert got.keys() == want.keys() and got
    worst = 0.0
    for k, g in want.items():
        scale = g.norm().item()
        diff = (got[k] - g).norm().item()
        worst = max(worst, diff / scale if scale > 0 else diff)
    return worst


def _forward(model, rows, responses, tree_max: int, max_tokens: int | None = None):
    """Per-row log-probs and the gradient of their sum over ``micro_batch_plan``'s micro-batches."""
    model.zero_grad()
    out = []
    for sl in micro_batch_plan(rows, responses, len(rows), max_tokens):
        packed = pack(rows[sl], responses[sl], PAD)
        assert uses_tree_packing(model, packed, True, tree_max) == (tree_max > 0)
        with lean_mlp(model), lean_norm(model):  # as the policy update runs it (LocalBackend.forward)
            logp, _ = forward_micro_batch(model, packed, TEMP, tree_max_tokens=tree_max)
        (logp * packed.response_mask).sum().backward()
        out.extend(logp[j, :len(r)].detach() for j, r in enumerate(responses[sl]))
    grads = _grads(model)
    model.zero_grad()
    return out, grads


def _greedy_alone(model, prompt: list[int], max_new: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                         do_sample=False, eos_token_id=[EOS], pad_token_id=PAD)[0, len(prompt):].tolist()
    return out[:out.index(EOS) + 1] if EOS in out else out


def measure(arch: str, path: str) -> dict:
    """``{"logprob": max abs diff, "grad": max relative diff (None where there is no gradient),
    "greedy": greedy tokens equal generate's (None where not decoding)}``."""
    model = _model(arch)
    prompts, rows, responses = _rows()
    ref_lp, ref_grads = _reference(arch)
    result = {"logprob": None, "grad": None, "greedy": None}
    if path in ("tree", "cached", "budget"):
        tree_max = 0 if path == "cached" else 2048
        lps, grads = _forward(model, rows, responses, tree_max, 60 if path == "budget" else None)
        diff = max((a - b).abs().max().item() for a, b in zip(lps, ref_lp))
        if path == "budget":  # the old/reference log-probs: the same plan, no graph
            got, _ = compute_log_probs(model, rows, responses, temperature=TEMP, micro_batch_size=16,
                                       pad_id=PAD, max_tokens=60)
            diff = max(diff, max((torch.from_numpy(a) - b).abs().max().item() for a, b in zip(got, ref_lp)))
        result.update(logprob=diff, grad=_grad_rel(grads, ref_grads))
    else:
        max_new = 10
        # 4 decode slots for 8 rows, and prompt 0 (the shortest, admitted first) ends at its first
        # greedy token: the third prompt then joins the batch while the second's rows still write
        # (continuous batching; architectures with sliding-window caches start it when the batch is empty).
        alone = [_greedy_alone(model, p, max_new) for p in prompts]
        eos = sorted({EOS, alone[0][0]})
        want = [next((w[:i + 1] for i, t in enumerate(w) if t in eos), w) for w in alone]
        engine = HFRolloutEngine(model, pad_id=PAD, eos_ids=eos, micro_batch_size=4)
        greedy = engine.generate(prompts, SamplingParams(n=2, temperature=0.0, max_new_tokens=max_new, seed=0))
        result["greedy"] = all(greedy.response_ids[2 * i + s] == w for i, w in enumerate(want) for s in range(2))
        sampled = engine.generate(prompts, SamplingParams(n=2, temperature=TEMP, max_new_tokens=max_new, seed=3))
        srows = [p for p in prompts for _ in range(2)]
        diff = 0.0
        with torch.no_grad():
            for p, r, lp in zip(srows, sampled.response_ids, sampled.rollout_logprobs):
                z = model(input_ids=torch.tensor([p + r])).logits[0, len(p) - 1:len(p) + len(r) - 1].float() / TEMP
                want_lp = torch.log_softmax(z, -1).gather(-1, torch.tensor(r)[:, None])[:, 0]
                diff = max(diff, (torch.tensor(lp) - want_lp).abs().max().item())
        result["logprob"] = diff
    return result


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("arch", ARCHS)
def test_parity_with_transformers(arch, path):
    r = measure(arch, path)
    assert r["logprob"] <= LP_TOL, r
    if r["grad"] is not None:
        assert r["grad"] <= GRAD_TOL, r
    if r["greedy"] is not None:
        assert r["greedy"], r


@pytest.mark.parametrize("arch", ["mistral", "gemma2", "gemma3"])
def test_tree_forward_under_activation_checkpointing(arch):
    # The dense variant (the model's own kernel, each layer type's tree mask) keeps the windows,
    # the soft-caps and Gemma 2's eager kernel too.
    model = _build(arch)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    _, rows, responses = _rows()
    lps, grads = _forward(model, rows, responses, 2048)
    ref_lp, ref_grads = _reference(arch)
    assert max((a - b).abs().max().item() for a, b in zip(lps, ref_lp)) <= LP_TOL
    assert _grad_rel(grads, ref_grads) <= GRAD_TOL


def test_an_unverified_architecture_runs_through_transformers_own_code(caplog):
    # A model type the matrix does not cover: its forward and decoding are transformers' own, and
    # one line says so for each.
    class Unverified(tf.MistralForCausalLM):
        pass

    torch.manual_seed(0)
    config = _configs()["mistral"]
    model = Unverified(config).eval()
    model.config.model_type = "not_in_the_matrix"
    prompts, rows, responses = _rows()
    ref = _reference("mistral")  # same weights: seed 0, then scaled
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(2.0)
    assert not uses_tree_packing(model, pack(rows, responses, PAD))
    with caplog.at_level(logging.WARNING, logger="trajflow.modeling"):
        got, _ = compute_log_probs(model, rows, responses, temperature=TEMP, micro_batch_size=16, pad_id=PAD)
        compute_log_probs(model, rows, responses, temperature=TEMP, micro_batch_size=16, pad_id=PAD)
        engine = HFRolloutEngine(model, pad_id=PAD, eos_ids=[EOS], micro_batch_size=16)
        out = engine.generate(prompts, SamplingParams(n=1, temperature=0.0, max_new_tokens=10, seed=0))
    assert max((torch.from_numpy(a) - b).abs().max().item() for a, b in zip(got, ref[0])) <= LP_TOL
    assert out.response_ids == [_greedy_alone(model, p, 10) for p in prompts]
    lines = [r.getMessage() for r in caplog.records if "not_in_the_matrix" in r.getMessage()]
    assert len(lines) == 2, lines  # one for the forward, one for decoding; not one per call
    assert all("transformers' own" in line for line in lines)


# Bring-your-own model directories: what a user's ``model.path`` may hold.


def _save(model, tok, out):
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def _smollm2_tokenizer(chat_template: bool = True):
    from transformers import AutoTokenizer

    from trajflow.models import builtin_tokenizer_dir

    tok = AutoTokenizer.from_pretrained(builtin_tokenizer_dir("smollm2-135m-instruct"))
    if not chat_template:
        tok.chat_template = None
    return tok


def test_a_users_directory_without_a_chat_template_trains_on_the_plain_prompt_format(tmp_path):
    # A base-model directory (safetensors, sliding window, no chat template) through the policy
    # worker: prompts in the documented plain format, rollout log-probs equal to the trainer's.
    from tests.test_policy_worker import ACTOR, MODEL, _rollout_cfg
    from trajflow.config import ActorConfig
    from trajflow.models import plain_prompt
    from trajflow.workers.policy import PolicyWorker

    tok = _smollm2_tokenizer(chat_template=False)
    torch.manual_seed(0)
    config = tf.MistralConfig(**(_BASE | dict(vocab_size=len(tok), pad_token_id=tok.pad_token_id,
                                              bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)),
                              sliding_window=WINDOW)
    path = _save(tf.MistralForCausalLM(config), tok, tmp_path / "base-model")
    assert list(path.glob("*.safetensors"))
    worker = PolicyWorker(str(path), ActorConfig(**ACTOR), MODEL, _rollout_cfg(), seed=0, num_threads=1)
    messages = [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Calculate 3 + 4."}],
                [{"role": "user", "content": "Calculate 12 - 5 please."}]]
    prompts = worker.tokenize_prompts(messages, 256)
    assert plain_prompt(messages[1]) == "user: Calculate 12 - 5 please.\nassistant:"
    assert prompts[1] == tok(plain_prompt(messages[1]))["input_ids"]
    out = worker.generate_sequences(prompts, SamplingParams(n=2, temperature=0.7, max_new_tokens=12, seed=1))
    rows = [p for p in prompts for _ in range(2)]
    again = worker.compute_log_prob(rows, out.response_ids, 0.7)
    assert all(torch.allclose(torch.from_numpy(a), torch.tensor(b), atol=1e-4)
               for a, b in zip(again, out.rollout_logprobs))


def test_load_errors_are_one_line(tmp_path):
    from trajflow.errors import ModelLoadError
    from trajflow.models import load_causal_lm

    vision = tmp_path / "vision"
    tf.CLIPVisionModel(tf.CLIPVisionConfig(hidden_size=32, intermediate_size=37, num_hidden_layers=1,
                                           num_attention_heads=2, image_size=30, patch_size=2)).save_pretrained(vision)
    with pytest.raises(ModelLoadError) as e:
        load_causal_lm(vision)
    assert "\n" not in str(e.value) and "no causal-LM head" in str(e.value) and "clip_vision_model" in str(e.value)
    empty = tmp_path / "no-weights"
    _configs()["llama"].save_pretrained(empty)
    with pytest.raises(ModelLoadError, match="no weights"):
        load_causal_lm(empty)


def test_an_architecture_without_a_causal_lm_head_is_one_cli_line(tmp_path):
    from tests.test_cli_errors import assert_one_line_error, run_cli

    vision = tmp_path / "vision"
    tf.CLIPVisionModel(tf.CLIPVisionConfig(hidden_size=32, intermediate_size=37, num_hidden_layers=1,
                                           num_attention_heads=2, image_size=30, patch_size=2)).save_pretrained(vision)
    _smollm2_tokenizer().save_pretrained(vision)
    rc, _, err = run_cli("train", f"model.path={vision}", f"store.root={tmp_path / 'runs'}")
    assert_one_line_error(rc, err, "model.path", "no causal-LM head")
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_an_architecture_without_sdpa_loads_with_its_eager_attention(tmp_path):
    from trajflow.models import load_causal_lm

    torch.manual_seed(0)
    path = tmp_path / "gemma2"
    tf.Gemma2ForCausalLM(_configs()["gemma2"]).save_pretrained(path)
    model = load_causal_lm(path, attn_implementation="sdpa")
    assert model.config._attn_implementation == "eager"
    assert uses_tree_packing(model, pack([[5, 6, 7], [5, 6, 8]], [[9, 10], [11]], PAD))


if __name__ == "__main__":
    torch.set_num_threads(1)
    print(f"| architecture | {' | '.join(PATHS)} |")
    print(f"|---|{'---|' * len(PATHS)}")
    for arch in ARCHS:
        cells = []
        for path in PATHS:
            r = measure(arch, path)
            cell = f"{r['logprob']:.1e}"
            if r["grad"] is not None:
                cell += f" / {r['grad']:.1e}"
            if r["greedy"] is not None:
                cell += " / greedy " + ("equal" if r["greedy"] else "DIFFERENT")
            cells.append(cell)
        print(f"| {arch} | {' | '.join(cells)} |", flush=True)
