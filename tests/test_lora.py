"""LoRA on the actor (peft): trajflow's fast paths through the adapters, the reference with adapters
off, the optimizer and checkpoints holding only the adapter, and ``final/``.

Expectations come from a plain per-row forward of the peft model itself (``peft_model(ids).logits``),
never from trajflow's own output; the adapters' ``lora_B`` is random so they change every value.
"""

import copy

import numpy as np
import pytest
import torch

from trajflow.stages.policy_update import UpdateBatch, UpdateRows, UpdateSettings
from trajflow.stages.rollout import SamplingParams
from trajflow.config import ActorConfig, ModelConfig, RolloutConfig
from trajflow.engines.hf import HFRolloutEngine
from trajflow.modeling import lora
from trajflow.modeling.forward import forward_micro_batch, uses_tree_packing
from trajflow.modeling.packing import pack
from trajflow.models import load_causal_lm

TOL = 1e-5
LORA = ModelConfig(dtype="float32", lora_rank=4, lora_alpha=8.0)


def _randomise_b(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)


@pytest.fixture(scope="module")
def peft_model(tiny_model_dir):
    torch.manual_seed(0)
    model = lora.apply_lora(load_causal_lm(str(tiny_model_dir), "float32", "cpu", "sdpa"), LORA)
    _randomise_b(model)
    model.eval()
    return model


def _plain_logprobs(model, prompt, response, temperature):
    """Per-row reference: the peft model's own full forward over prompt + response."""
    ids = torch.tensor([list(prompt) + list(response)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float() / temperature
    lp = torch.log_softmax(logits[len(prompt) - 1:-1], -1)
    tok = torch.tensor(response)
    p = lp.exp()
    return lp.gather(-1, tok[:, None])[:, 0], -(p * lp).sum(-1)


PREFIX = [1, 28, 50, 71, 300, 12, 9]
PROMPTS = [PREFIX + [5, 6, 7], PREFIX + [5, 6, 7], PREFIX + [44, 2], PREFIX + [88]]
RESPONSES = [[10, 11, 12, 13], [20, 21], [30, 31, 32, 33, 34], [40]]


@pytest.mark.parametrize("path", ["tree", "cached_prompts"])
def test_training_forward_through_adapters_matches_plain_forward(peft_model, path):
    packed = pack(PROMPTS, RESPONSES, pad_id=0)
    kw = {} if path == "tree" else {"tree_max_tokens": 0}
    assert uses_tree_packing(peft_model, packed, **kw) == (path == "tree")
    with torch.no_grad():
        logp, ent = forward_micro_batch(peft_model, packed, 0.7, compute_entropy=True, **kw)
    base = copy.deepcopy(peft_model)
    with torch.no_grad(), base.disable_adapter():
        base_lp, _ = forward_micro_batch(base, packed, 0.7, **kw)
    for j, (p, r) in enumerate(zip(PROMPTS, RESPONSES)):
        want_lp, want_ent = _plain_logprobs(peft_model, p, r, 0.7)
        assert torch.allclose(logp[j, :len(r)], want_lp, atol=TOL, rtol=0)
        assert torch.allclose(ent[j, :len(r)], want_ent, atol=TOL, rtol=0)
        # The adapters matter: without them the values differ by far more than the tolerance.
        assert (base_lp[j, :len(r)] - want_lp).abs().max() > 1e-3


def test_decode_loop_and_shared_prefill_through_adapters(peft_model):
    engine = HFRolloutEngine(peft_model, pad_id=0, eos_ids=[2], micro_batch_size=8)
    prompts = [PREFIX + [5, 6, 7], PREFIX + [44, 2, 9]]
    out = engine.generate(prompts, SamplingParams(n=2, temperature=0.8, max_new_tokens=6, seed=3))
    rows = [p for p in prompts for _ in range(2)]
    for p, r, got in zip(rows, out.response_ids, out.rollout_logprobs):
        want, _ = _plain_logprobs(peft_model, p, r, 0.8)
        assert np.allclose(np.asarray(got), want.numpy(), atol=TOL, rtol=0)
    greedy = engine.generate(prompts, SamplingParams(n=1, temperature=0.0, max_new_tokens=6, seed=0))
    for p, r in zip(prompts, greedy.response_ids):
        ids = torch.tensor([p + r])
        with torch.no_grad():
            logits = peft_model(input_ids=ids).logits[0]
        assert logits[len(p) - 1:-1].argmax(-1).tolist() == r


def test_merged_state_dict_is_peft_merge(peft_model):
    merged = lora.merged_state_dict(peft_model)
    want = copy.deepcopy(peft_model).merge_and_unload().state_dict()
    assert set(merged) == set(want)
    assert all(torch.equal(merged[k], want[k]) for k in want)


# ---------------------------------------------------------------------------------------- worker

ACTOR = dict(lr=1e-2, betas=[0.9, 0.999], weight_decay=0.0, ppo_micro_batch_size=2, ppo_epochs=1, shuffle=False,
             policy_loss="vanilla", clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0,
             loss_agg_mode="token-mean", entropy_coeff=0.0, kl_loss_coef=0.1, kl_loss_type="low_var_kl+",
             grad_clip=1.0)


def _worker(model_dir):
    from trajflow.workers.policy import PolicyWorker

    return PolicyWorker(str(model_dir), ActorConfig(**ACTOR), LORA, RolloutConfig(micro_batch_size=4, temperature=0.7),
                        seed=0, num_threads=1)


def _step(worker, seed=1):
    prompts = worker.tokenize_prompts([[{"role": "user", "content": "Calculate 3 + 4."}],
                                       [{"role": "user", "content": "Calculate 12 - 5 please."}]], 256)
    out = worker.generate_sequences(prompts, SamplingParams(n=2, temperature=0.7, max_new_tokens=6, seed=seed))
    rows = [p for p in prompts for _ in range(2)]
    ref = worker.compute_ref_log_prob(rows, out.response_ids)
    adv = [[1.0 if i % 2 else -1.0] * len(r) for i, r in enumerate(out.response_ids)]
    batch = UpdateBatch(UpdateRows(rows, out.response_ids, out.rollout_logprobs, adv, ref_logprobs=ref),
                        UpdateSettings(4, shuffle_seed=seed, rng_seed=seed))
    return rows, out, ref, worker.update_actor(batch)


def test_reference_is_the_base_model_and_only_adapters_train(tiny_model_dir, tmp_path):
    from safetensors import safe_open

    from trajflow.workers.policy import ADAPTER_FILE

    w = _worker(tiny_model_dir)
    opt_params = [p for g in w.optimizer.param_groups for p in g["params"]]
    names = {id(p): n for n, p in w.model.named_parameters()}
    assert opt_params and all("lora_" in names[id(p)] for p in opt_params)
    base_before = {k: v.clone() for k, v in w.model.get_base_model().state_dict().items() if "lora_" not in k}
    rows, out, ref, metrics = _step(w)
    assert metrics["policy_version"] == 1 and metrics["actor/kl_loss"] == pytest.approx(0.0, abs=1e-6)
    plain = load_causal_lm(str(tiny_model_dir), "float32", "cpu", "sdpa").eval()
    for p, r, got in zip(rows, out.response_ids, ref):
        want, _ = _plain_logprobs(plain, p, r, 0.7)
        assert np.allclose(got, want.numpy(), atol=TOL, rtol=0)
    after = w.model.get_base_model().state_dict()
    assert all(torch.equal(after[k], v) for k, v in base_before.items())  # the base never moves
    # After a step the policy is no longer the reference; the reference still is the base model.
    rows, out, ref2, metrics = _step(w, seed=2)
    now = w.compute_log_prob(rows, out.response_ids, 0.7)
    assert max(float(np.abs(a - b).max()) for a, b in zip(now, ref2)) > 1e-4
    assert metrics["actor/kl_loss"] > 0

    ckpt = tmp_path / "actor"
    w.save_checkpoint(str(ckpt))
    assert not (ckpt / "model.safetensors").exists()
    with safe_open(str(ckpt / ADAPTER_FILE), "pt") as f:
        keys = list(f.keys())
    assert keys and all("lora_" in k for k in keys)
    n_base = sum(v.numel() for v in base_before.values())
    n_adapter = sum(p.numel() for p in opt_params)
    assert (ckpt / ADAPTER_FILE).stat().st_size < 4 * n_adapter + 64 * 1024 < 4 * n_base

    fresh = _worker(tiny_model_dir)
    fresh.load_checkpoint(str(ckpt))
    assert fresh.weights_digest() == w.weights_digest()
    _, _, _, m1 = _step(w, seed=3)
    _, _, _, m2 = _step(fresh, seed=3)
    assert fresh.weights_digest() == w.weights_digest()
    assert m1["actor/pg_loss"] == m2["actor/pg_loss"]

    final = tmp_path / "final"
    w.export_hf(str(final))
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(final).eval()
    assert not any("lora" in k for k in merged.state_dict())
    again = PeftModel.from_pretrained(load_causal_lm(str(tiny_model_dir), "float32", "cpu", "sdpa"),
                                      final / lora.ADAPTER_DIR).eval()
    ids = torch.tensor([rows[0] + out.response_ids[0]])
    with torch.no_grad():
        want = w.model.eval()(input_ids=ids).logits
        assert torch.allclose(merged(input_ids=ids).logits, want, atol=1e-5, rtol=0)
        assert torch.allclose(again(input_ids=ids).logits, want, atol=1e-5, rtol=0)


def test_full_weight_checkpoint_is_refused_by_a_lora_worker(tiny_model_dir, tmp_path):
    from trajflow.workers.policy import PolicyWorker

    full = PolicyWorker(str(tiny_model_dir), ActorConfig(**ACTOR), ModelConfig(dtype="float32"),
                        RolloutConfig(micro_batch_size=4), seed=0, num_threads=1)
    full.save_checkpoint(str(tmp_path / "actor"))
    with pytest.raises(RuntimeError, match="full-weight checkpoint; this run has model.lora_rank=4"):
        _worker(tiny_model_dir).load_checkpoint(str(tmp_path / "actor"))


def test_rl_forwards_run_without_dropout(tiny_model_dir):
    """A worker given lora_dropout=0.3 directly (the config refuses it) and a model whose attention
    has dropout: the PPO ratio of the first step of a 2-mini-batch update compares the training
    forward with log-probs recomputed without dropout, so it must be exactly 1 (deviation 0)."""
    from trajflow.workers.policy import PolicyWorker

    import dataclasses

    cfg = dataclasses.replace(LORA, lora_dropout=0.3)
    w = PolicyWorker(str(tiny_model_dir), ActorConfig(**ACTOR), cfg, RolloutConfig(micro_batch_size=4, temperature=0.7),
                     seed=0, num_threads=1)
    drops = [m for m in w.model.modules() if isinstance(m, torch.nn.Dropout)]
    assert drops and all(m.p == 0.0 for m in drops)  # peft built lora_dropout modules; they are off
    _randomise_b(w.model)  # B != 0: the adapters' input (where the dropout sat) changes the output
    rng = np.random.default_rng(0)
    prompts = [PREFIX + [int(t)] for t in rng.integers(10, 2000, size=4)]
    resps = [rng.integers(10, 2000, size=6).tolist() for _ in range(4)]
    old = w.compute_log_prob(prompts, resps, 0.7)
    batch = UpdateBatch(UpdateRows(prompts, resps, [x.tolist() for x in old], [[1.0] * 6, [-1.0] * 6] * 2),
                        UpdateSettings(2, shuffle_seed=0, rng_seed=0))
    m = w.update_actor(batch)
    assert m["actor/ratio_first_step_max_abs_dev"] == pytest.approx(0.0, abs=1e-6)
    from trajflow.models import disable_dropout

    attn = next(m for m in w.model.modules() if hasattr(m, "attention_dropout"))
    attn.attention_dropout = 0.2
    assert disable_dropout(w.model) == 1 and attn.attention_dropout == 0.0


@pytest.mark.parametrize("overrides, message", [
    (["model.target_modules=[]"], "model.target_modules=[] must be 'all-linear' or a non-empty list"),
    (["model.target_modules=attention"], "model.target_modules='attention' must be 'all-linear'"),
    (["model.lora_rank=4", "model.lora_dropout=0.1"], "model.lora_dropout=0.1 is refused: RL updates run without "
                                                      "dropout"),
])
def test_lora_config_errors_are_one_line(overrides, message):
    from trajflow.config import load_config
    from trajflow.errors import ConfigError

    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")) as e:
        load_config(None, overrides)
    assert "\n" not in str(e.value)


def test_lora_recipe_resolves():
    from trajflow.config import load_config

    cfg = load_config("grpo_lora", [])
    assert cfg.model.lora_rank == 16 and cfg.model.target_modules == "all-linear" and cfg.actor.lr >= 1e-4


def test_separate_rollout_workers_get_the_merged_weights(tiny_model_dir):
    from trajflow.workers.rollout import RolloutWorker

    policy = _worker(tiny_model_dir)
    _randomise_b(policy.model, seed=5)
    remote = RolloutWorker(str(tiny_model_dir), RolloutConfig(micro_batch_size=4), LORA, seed=0, num_threads=1)

    from trajflow.engines.base import RolloutEngine, WeightSync

    class ToWorker(RolloutEngine):  # RemoteRolloutEngine's contract, without Ray in between
        weight_sync = (WeightSync.FULL,)
        weights_from_rank0 = True

        def generate(self, prompt_ids, params):
            raise NotImplementedError

        def update_weights(self, state, version=None):
            remote.update_weights(state, version)

    own = policy.engine
    policy._set_engine(ToWorker())
    policy._push_weights()
    params = SamplingParams(n=2, temperature=0.8, max_new_tokens=5, seed=2)
    prompts = [PREFIX + [5, 6, 7], PREFIX + [44]]
    mine, theirs = own.generate(prompts, params), remote.generate(prompts, params)
    assert mine.response_ids == theirs.response_ids
    for a, b in zip(mine.rollout_logprobs, theirs.rollout_logprobs):
        assert np.allclose(a, b, atol=TOL, rtol=0)


# ---------------------------------------------------------------------------------------- rsLoRA

RSLORA = ModelConfig(dtype="float32", lora_rank=4, lora_alpha=8.0, lora_use_rslora=True)


def test_rslora_scale_is_alpha_over_sqrt_rank_in_merge_and_export(tiny_model_dir, tmp_path):
    """rsLoRA (Kalajdzievski 2023, Theorem 3.2): W' = W + (alpha / sqrt(r)) B A = W + (8 / 2) B A here,
    twice plain LoRA's alpha / r = 2. Checked from the raw A, B and W tensors, on the merge (weight sync
    to rollout workers), on final/ (merged weights and adapter_config.json, which vLLM reads: use_rslora)
    and on the checkpoint's record."""
    import json

    from trajflow.workers.policy import PolicyWorker

    assert lora.adapter_scaling(4, 8.0, True) == 4.0 and lora.adapter_scaling(4, 8.0, False) == 2.0
    torch.manual_seed(0)
    model = lora.apply_lora(load_causal_lm(str(tiny_model_dir), "float32", "cpu", "sdpa"), RSLORA)
    _randomise_b(model)
    base = model.get_base_model()
    name = next(n for n, m in base.named_modules() if hasattr(m, "lora_A") and "q_proj" in n)
    layer = base.get_submodule(name)
    a, b = layer.lora_A[lora.ADAPTER].weight, layer.lora_B[lora.ADAPTER].weight
    w = layer.base_layer.weight
    merged = lora.merged_state_dict(model)
    torch.testing.assert_close(merged[f"{name}.weight"], w + 4.0 * (b @ a), rtol=0, atol=1e-6)

    worker = PolicyWorker(str(tiny_model_dir), ActorConfig(**ACTOR), RSLORA, RolloutConfig(micro_batch_size=4),
                          seed=0, num_threads=1)
    _randomise_b(worker.model, seed=1)
    final = tmp_path / "final"
    worker.export_hf(str(final))
    cfg = json.loads((final / lora.ADAPTER_DIR / "adapter_config.json").read_text())
    assert cfg["use_rslora"] is True and cfg["r"] == 4 and cfg["lora_alpha"] == 8.0
    # what the vLLM engine's update_adapter writes as adapter_config.json (vLLM scales by alpha / sqrt(r) when
    # use_rslora is set): the policy's own peft config
    sync = tmp_path / "sync"
    worker.model.peft_config[lora.ADAPTER].save_pretrained(str(sync))
    assert json.loads((sync / "adapter_config.json").read_text())["use_rslora"] is True
    from safetensors.torch import load_file
    exported = load_file(str(final / "model.safetensors"))
    wl = worker.model.get_base_model().get_submodule(name)
    want = wl.base_layer.weight + 4.0 * (wl.lora_B[lora.ADAPTER].weight @ wl.lora_A[lora.ADAPTER].weight)
    torch.testing.assert_close(exported[f"{name}.weight"], want.detach(), rtol=0, atol=1e-6)

    ckpt = tmp_path / "actor"
    worker.save_checkpoint(str(ckpt))
    state = json.loads((ckpt / "actor_state.json").read_text())
    assert state["lora_use_rslora"] is True and state["lora_scaling"] == 4.0 and state["lora_alpha"] == 8.0
    # A plain-LoRA run refuses the rsLoRA adapter (same tensors, another model), one line naming the key.
    with pytest.raises(RuntimeError, match="model.lora_use_rslora=True, this run has model.lora_use_rslora=False"):
        _worker(tiny_model_dir).load_checkpoint(str(ckpt))
    again = PolicyWorker(str(tiny_model_dir), ActorConfig(**ACTOR), RSLORA, RolloutConfig(micro_batch_size=4),
                         seed=0, num_threads=1)
    again.load_checkpoint(str(ckpt))
    assert again.weights_digest() == worker.weights_digest()


def test_a_checkpoint_trained_with_another_alpha_is_refused(tiny_model_dir, tmp_path):
    """Same rank and targets, lora_alpha 8 vs 16: the adapter's tensors would load and compute a
    policy scaled twice as much (s = alpha / r = 2 vs 4), so the checkpoint is refused in one line."""
    import dataclasses
    import json

    from trajflow.workers.policy import PolicyWorker

    w = _worker(tiny_model_dir)
    w.save_checkpoint(str(tmp_path / "actor"))
    state = json.loads((tmp_path / "actor" / "actor_state.json").read_text())
    assert (state["lora_alpha"], state["lora_use_rslora"], state["lora_scaling"]) == (8.0, False, 2.0)
    other = PolicyWorker(str(tiny_model_dir), ActorConfig(**ACTOR), dataclasses.replace(LORA, lora_alpha=16.0),
                         RolloutConfig(micro_batch_size=4), seed=0, num_threads=1)
    with pytest.raises(RuntimeError, match=r"model.lora_alpha=8.0, this run has model.lora_alpha=16.0") as e:
        other.load_checkpoint(str(tmp_path / "actor"))
    assert "\n" not in str(e.value)
