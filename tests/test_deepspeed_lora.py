"""LoRA under DeepSpeed data parallel (CPU, gloo), ZeRO-2 and ZeRO-3: 2 ranks update the adapters as
one process does, a checkpoint holds the adapters and their optimizer state without the frozen base,
and ``final/`` is the merged model (checked against ``W + (alpha / r) B A`` computed here in numpy).

Tolerance as in tests/test_deepspeed_ranks.py: the ranks differ from one process only in float
summation order of the all-reduced gradients.
"""

from __future__ import annotations

import numpy as np
import pytest

from trajflow.stages.rollout import SamplingParams
from tests.test_deepspeed_ranks import ACTOR, ROLLOUT, assert_close, make_batch
from tests.payloads import RunsCode
from trajflow.config import ActorConfig, ModelConfig
from trajflow.modeling.backends import deepspeed_safe_globals
from trajflow.workers.group import WorkerGroup

LORA = ModelConfig(dtype="float32", lora_rank=4, lora_alpha=8, target_modules="all-linear")
PROMPTS = [[11, 52, 903, 7], [400, 31], [1500, 8, 8, 64, 2]]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6)


def adapters(weights: dict) -> dict:
    return {k: v for k, v in weights.items() if "lora_" in k}


@pytest.fixture(scope="module")
def one_rank_lora(tiny_model_dir):
    from trajflow.workers.policy import PolicyWorker

    w = PolicyWorker(str(tiny_model_dir), ActorConfig(**{**ACTOR, "kl_loss_coef": 0.0}), LORA, ROLLOUT, seed=0,
                     num_threads=1)
    b1, b2 = make_batch(w, 0), make_batch(w, 1)
    w0 = w.get_weights()
    w.update_actor(b1)
    w1 = w.get_weights()
    gen1 = w.generate_sequences(PROMPTS, GREEDY).response_ids
    w.update_actor(b2)
    ref_logp = w.compute_ref_log_prob(b1.rows.prompt_ids, b1.rows.response_ids)
    return {"b1": b1, "b2": b2, "w0": w0, "w1": w1, "w2": w.get_weights(), "ref_logp": ref_logp,
            "gen1": gen1}


def merged_by_hand(weights: dict) -> dict:
    """``W + (alpha / r) B A`` per adapted layer, under the plain model's names, from numpy weights."""
    scale = LORA.lora_alpha / LORA.lora_rank
    out = {}
    for k, v in weights.items():
        if "lora_" in k:
            continue
        name = k.replace("base_model.model.", "", 1).replace(".base_layer.", ".")
        if ".base_layer.weight" in k:
            layer = k[:-len(".base_layer.weight")]
            v = v + scale * weights[f"{layer}.lora_B.default.weight"] @ weights[f"{layer}.lora_A.default.weight"]
        out[name] = v
    return out


def spawn_lora(model_dir, zero_stage: int = 2) -> WorkerGroup:
    from trajflow.workers.policy import PolicyWorker

    actor = ActorConfig(**{**ACTOR, "kl_loss_coef": 0.0, "strategy": "deepspeed", "zero_stage": zero_stage,
                           "world_size": 2})
    group = WorkerGroup.spawn(PolicyWorker, (str(model_dir), actor, LORA, ROLLOUT, 0, "cpu", 1),
                              [{"num_cpus": 0}] * 2, "actor", lockstep=zero_stage == 3)
    group.init_distributed()
    return group


def test_lora_with_zero3_is_accepted():
    from trajflow.config import load_config

    cfg = load_config(None, ["model.lora_rank=8", "actor.strategy=deepspeed", "actor.zero_stage=3",
                             "actor.world_size=2"])
    assert (cfg.model.lora_rank, cfg.actor.zero_stage) == (8, 3)


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_lora_two_ranks_equal_one_rank_and_resume(ray_local, tiny_model_dir, one_rank_lora, tmp_path, zero_stage):
    ref = one_rank_lora
    group = spawn_lora(tiny_model_dir, zero_stage)
    try:
        assert adapters(group.execute("get_weights")).keys() == adapters(ref["w0"]).keys() != set()
        group.execute("update_actor", ref["b1"])
        w1 = group.execute("get_weights")
        assert_close(adapters(w1), adapters(ref["w1"]))
        base = [k for k in w1 if "lora_" not in k]
        assert all(np.array_equal(w1[k], ref["w0"][k]) for k in base)  # the base stays frozen
        assert max(float(np.abs(w1[k] - ref["w0"][k]).max()) for k in adapters(w1)) > 1e-4
        # The reference policy is the frozen base, with the adapters disabled (gathered by ZeRO-3's hooks).
        ref_logp = group.execute("compute_ref_log_prob", ref["b1"].rows.prompt_ids, ref["b1"].rows.response_ids)
        assert max(float(np.abs(a - b).max()) for a, b in zip(ref_logp, ref["ref_logp"])) < 1e-5
        # The hf engine decodes with the trained module (under ZeRO-3: generate(synced_gpus=True)).
        assert group.execute("generate_sequences", PROMPTS, GREEDY).response_ids == ref["gen1"]
        group.execute("save_checkpoint", str(tmp_path / "ck"))
        group.execute("export_hf", str(tmp_path / "final"))
    finally:
        group.kill()
    from safetensors.numpy import load_file
    from transformers import AutoModelForCausalLM

    # final/: the merged weights as a plain model, and the adapter in peft's format.
    exported = {k: v.detach().numpy() for k, v in AutoModelForCausalLM.from_pretrained(tmp_path / "final")
                .state_dict().items()}
    assert_close(exported, merged_by_hand(w1))
    base = merged_by_hand(ref["w0"])  # B = 0 at the start: the plain base weights
    assert max(float(np.abs(exported[k] - base[k]).max()) for k in base) > 1e-4  # the adapters were merged in
    saved = load_file(tmp_path / "final" / "adapter" / "adapter_model.safetensors")
    assert saved.keys() == {k.replace(".default", "") for k in adapters(w1)}
    assert all(np.array_equal(v, w1[k.replace(".weight", ".default.weight")]) for k, v in saved.items())
    from tests.test_export import assert_offline_export_equals

    lora_cfg = {"path": str(tiny_model_dir), **{k: getattr(LORA, k) for k in (
        "lora_rank", "lora_alpha", "lora_dropout", "lora_use_rslora", "target_modules")}}
    assert_offline_export_equals(tmp_path / "ck", lora_cfg, tmp_path / "final", tmp_path / "offline", "deepspeed",
                                 exact=False)
    import torch

    # Adapters and their optimizer state, not the frozen base (DeepSpeed keeps the tied
    # embedding's entry, lm_head.weight, whatever is frozen: it records shared parameters).
    shards = tmp_path / "ck" / "deepspeed" / "latest"
    name = "zero_pp_rank_0_mp_rank_00_model_states.pt" if zero_stage == 3 else "mp_rank_00_model_states.pt"
    module = torch.load(shards / name, weights_only=True)["module"]
    frozen = [k for k in module if "lora_" not in k]
    assert frozen == ["model.base_model.model.lm_head.weight"], frozen
    assert {k.replace("model.base_model.model.", "").replace(".default", "") for k in module if "lora_" in k} \
        == {k.replace("base_model.model.", "").replace(".default", "") for k in adapters(ref["w0"])}
    if zero_stage == 3:
        # ZeRO-3 partitions every parameter: the module entries are empty placeholders and the
        # adapters' values live in the ranks' fp32 partitions, which together hold exactly the
        # adapters' elements (r * (in + out) per targeted layer), no base weight.
        assert all(v.numel() == 0 for v in module.values())
    held = 0
    for rank in range(2):
        with torch.serialization.safe_globals(deepspeed_safe_globals()):
            optim = torch.load(shards / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt",
                               weights_only=True)["optimizer_state_dict"]
        flat = optim["fp32_flat_groups"] if zero_stage == 3 else optim["single_partition_of_fp32_groups"]
        held += sum(t.numel() for t in flat)
        moments = optim["optimizer_state_dict" if zero_stage == 3 else "base_optimizer_state"]["state"].values()
        assert sum(s["exp_avg"].numel() for s in moments) == sum(t.numel() for t in flat)
    assert held == sum(v.size for v in adapters(ref["w0"]).values()), held

    fresh = spawn_lora(tiny_model_dir, zero_stage)
    try:
        assert fresh.execute("load_checkpoint", str(tmp_path / "ck")) == {"policy_version": 1}
        assert all(np.array_equal(v, w1[k]) for k, v in fresh.execute("get_weights").items())
        fresh.execute("update_actor", ref["b2"])  # the optimizer state came back: the same second step
        assert_close(adapters(fresh.execute("get_weights")), adapters(ref["w2"]))
    finally:
        fresh.kill()


def test_tampered_deepspeed_shard_is_refused_without_running_it(ray_local, tiny_model_dir, tmp_path):
    """DeepSpeed unpickles its shards with weights_only=False; trajflow's engine loads them weights-only,
    so a shard carrying an object whose unpickling runs a command fails to load and runs nothing."""
    import ray
    import torch

    group = spawn_lora(tiny_model_dir)
    try:
        group.execute("save_checkpoint", str(tmp_path / "ck"))
        shard = tmp_path / "ck" / "deepspeed" / "latest" / "mp_rank_00_model_states.pt"
        state = torch.load(shard, weights_only=True)
        marker = tmp_path / "ran"
        state["ds_version"] = RunsCode(str(marker))
        torch.save(state, shard)
        with pytest.raises(ray.exceptions.RayTaskError, match="weights_only|Unsupported global"):
            group.execute("load_checkpoint", str(tmp_path / "ck"))
        assert not marker.exists(), "the tampered shard ran code"
    finally:
        group.kill()
