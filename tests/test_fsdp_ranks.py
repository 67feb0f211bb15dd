"""FSDP2 (``fully_shard``) data parallel on CPU (gloo): 2 ranks as 2 Ray actors vs the one-process update.

Tolerances. float32: the ranks differ from one process only in float summation order (the
gradients are summed by a reduce-scatter instead of inside one backward), so after two AdamW steps
(lr 1e-3) the weights agree to ``1e-5 * max|w|`` as in tests/test_deepspeed_ranks.py (a wrong
gradient, denominator or missing micro-batch moves weights by ~1e-3). bfloat16 compute: both sides
run the matmuls in bf16 (8 mantissa bits, relative rounding 2**-8 = 3.9e-3), but FSDP2 also casts the
gathered norm weights and the activations between blocks to bf16 where the one-process autocast keeps
them float32; the losses then agree to a few bf16 roundings (rel 2e-2). AdamW's normalised step
turns a rounding difference in a near-zero gradient into a different step of size ~lr, so single
weights may differ by a few lr (the one-process bf16 run itself is up to 5.3e-3 from the float32
one here): the largest difference is bounded by 1.5x that cost of bf16, the mean difference by
1e-4 (a wrong gradient moves every weight by ~lr = 1e-3).
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.test_deepspeed_lora import one_rank_lora  # noqa: F401  (a fixture)
from tests.test_deepspeed_ranks import ACTOR, MODEL, ROLLOUT, assert_close, make_batch
from tests.payloads import RunsCode
from trajflow.config import ActorConfig
from trajflow.workers.group import WorkerGroup

BF16 = {"mixed_precision": {"param_dtype": "bfloat16", "reduce_dtype": "float32", "buffer_dtype": "float32"}}


def actor_config(**extra) -> ActorConfig:
    from omegaconf import OmegaConf

    base = OmegaConf.structured(ActorConfig)
    merged = OmegaConf.merge(base, {**ACTOR, **extra})
    return OmegaConf.to_object(merged)


def spawn_fsdp(model_dir, world: int = 2, model_cfg=MODEL, **extra) -> WorkerGroup:
    from trajflow.workers.policy import PolicyWorker

    actor = actor_config(strategy="fsdp2", world_size=world, **extra)
    group = WorkerGroup.spawn(PolicyWorker, (str(model_dir), actor, model_cfg, ROLLOUT, 0, "cpu", 1),
                              [{"num_cpus": 0}] * world, "actor", lockstep=True)
    group.init_distributed()
    return group


def two_steps(group_or_worker, b1, b2, call) -> dict:
    m1 = call("update_actor", b1)
    w1 = call("get_weights")
    m2 = call("update_actor", b2)
    return {"m1": m1, "w1": w1, "m2": m2, "w2": call("get_weights")}


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """The one-process worker (torch AdamW), two updates on two batches, in float32 and in bf16 compute."""
    from trajflow.workers.policy import PolicyWorker

    out = {}
    for name, extra in (("fp32", {}), ("bf16", BF16)):
        w = PolicyWorker(str(tiny_model_dir), actor_config(**extra), MODEL, ROLLOUT, seed=0, num_threads=1)
        b1, b2 = make_batch(w, 0), make_batch(w, 1)
        w0 = w.get_weights()
        out[name] = {"b1": b1, "b2": b2, "w0": w0,
                     **two_steps(w, b1, b2, lambda m, *a: getattr(w, m)(*a))}
    return out


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_two_ranks_two_steps_equal_one_process(ray_local, tiny_model_dir, reference, precision):
    ref = reference[precision]
    group = spawn_fsdp(tiny_model_dir, **(BF16 if precision == "bf16" else {}))
    try:
        got = two_steps(group, ref["b1"], ref["b2"], group.execute)
    finally:
        group.kill()
    moved = max(float(np.abs(got["w2"][k] - ref["w0"][k]).max()) for k in got["w2"])
    assert moved > 1e-3  # the steps did move the weights
    for step in ("m1", "m2"):
        for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm"):
            rel = 1e-4 if precision == "fp32" else 2e-2
            assert got[step][key] == pytest.approx(ref[step][key], rel=rel, abs=1e-6), (step, key)
    if precision == "fp32":
        assert_close(got["w1"], ref["w1"])
        assert_close(got["w2"], ref["w2"])
    else:
        # bf16 itself moves the one-process weights by this much (vs float32): FSDP2 in bf16 may not be
        # further from the one-process bf16 run than that.
        cost = max(float(np.abs(reference["fp32"]["w2"][k] - ref["w2"][k]).max()) for k in ref["w2"])
        worst = max(float(np.abs(got["w2"][k] - ref["w2"][k]).max()) for k in ref["w2"])
        assert worst <= 1.5 * cost, (worst, cost)
        mean = np.mean([float(np.abs(got["w2"][k] - ref["w2"][k]).mean()) for k in ref["w2"]])
        assert mean <= 1e-4, mean  # most weights agree far more closely (a wrong gradient moves all by ~1e-3)


def test_hybrid_mesh_token_budget_offload_checkpointing(ray_local, tiny_model_dir, reference):
    """verl's other knobs, one 2-rank group: a 2-D mesh (fsdp_size=1: 2 replicas x 1 shard, HSDP's
    layout), token-budget micro-batches that differ in number between the ranks (the shorter one
    pads), parameters kept gathered between forward and backward, CPU offload, activation
    checkpointing: the update still equals the one-process one."""
    from trajflow.config import ModelConfig
    from trajflow.modeling.packing import balanced_partition, token_budget_slices

    ref, budget = reference["fp32"], 14
    b1 = ref["b1"]
    weights = [len(b1.rows.prompt_ids[r]) + len(b1.rows.response_ids[r]) for r in range(5)]
    counts = [len(token_budget_slices([b1.rows.prompt_ids[r] for r in p], [b1.rows.response_ids[r] for r in p],
                                      budget)) for p in balanced_partition(weights, 2)]
    assert counts[0] != counts[1] and max(counts) > 1, counts  # uneven: the padding path runs
    group = spawn_fsdp(tiny_model_dir, model_cfg=ModelConfig(dtype="float32", gradient_checkpointing=True),
                       use_dynamic_bsz=True, ppo_max_token_len_per_gpu=budget,
                       fsdp={"fsdp_size": 1, "reshard_after_forward": False, "offload_params": True})
    try:
        group.execute("update_actor", b1)
        assert_close(group.execute("get_weights"), ref["w1"])
    finally:
        group.kill()


def test_token_budget_log_probs_with_uneven_micro_batch_counts(ray_local, tiny_model_dir, reference):
    """Old log-probs with token-budget micro-batches (``use_dynamic_bsz``) on 2 sharded ranks whose
    shares cut into different numbers of micro-batches: every forward is a collective, so the rank
    with fewer runs padding forwards (without them it waits on the other rank forever); the
    log-probs equal the one-process worker's, computed in fixed micro-batches before any update."""
    import ray

    from trajflow.modeling.packing import token_budget_slices
    from trajflow.workers.group import plan_split

    rows = reference["fp32"]["b1"].rows
    prompts, resps = rows.prompt_ids, rows.response_ids

    def counts(budget: int) -> list[int]:
        parts, _ = plan_split({"p": prompts, "r": resps}, ("p", "r"), 2, pad=True)
        return [len(token_budget_slices([prompts[i] for i in p], [resps[i] for i in p], budget)) for p in parts]

    budget = next((b for b in range(8, 64) if len(set(counts(b))) > 1), None)
    assert budget is not None, "no budget gives the ranks different micro-batch counts"
    group = spawn_fsdp(tiny_model_dir, use_dynamic_bsz=True, ppo_max_token_len_per_gpu=budget)
    try:
        got = ray.get(group.compute_log_prob.remote(prompts, resps, 1.0), timeout=180)
    finally:
        group.kill()
    assert len(got) == len(resps)
    for i, (g, want) in enumerate(zip(got, rows.rollout_logprobs)):
        assert g.shape == (len(resps[i]),)
        np.testing.assert_allclose(g, want, rtol=0, atol=1e-5, err_msg=f"row {i}")


def test_checkpoint_resume_export_never_unpickles(ray_local, tiny_model_dir, reference, tmp_path):
    """Sharded save -> load on fresh ranks gives the same weights bit for bit and the same next
    step; the checkpoint is safetensors + JSON only, and pickles planted where
    torch.distributed.checkpoint would keep its files are never read; final/ is a Hugging Face model."""
    import pickle

    from transformers import AutoModelForCausalLM

    ref = reference["fp32"]
    group = spawn_fsdp(tiny_model_dir)
    try:
        group.execute("update_actor", ref["b1"])
        w1 = group.execute("get_weights")
        group.execute("save_checkpoint", str(tmp_path / "ck"))
        group.execute("update_actor", ref["b2"])
        w2 = group.execute("get_weights")
        assert_close(w2, ref["w2"])
    finally:
        group.kill()
    ck = tmp_path / "ck"
    # rank 0's index (state, mesh, global shapes) and one file pair per rank (shards, AdamW moments, RNG)
    assert sorted(p.name for p in ck.iterdir()) == [f"{stem}.{ext}" for stem in ("actor_state", "fsdp_rank00000",
                                                                                 "fsdp_rank00001")
                                                    for ext in ("json", "safetensors")]
    marker = tmp_path / "ran"
    for name in (".metadata", "__0_0.distcp", "optim.pt", "fsdp_rank00000.pt"):
        (ck / name).write_bytes(pickle.dumps(RunsCode(str(marker))))

    fresh = spawn_fsdp(tiny_model_dir)
    try:
        assert fresh.execute("load_checkpoint", str(ck)) == {"policy_version": 1}
        loaded = fresh.execute("get_weights")
        assert all(np.array_equal(loaded[k], w1[k]) for k in w1)
        fresh.execute("export_hf", str(tmp_path / "hf"))
        fresh.execute("update_actor", ref["b2"])  # the AdamW moments came back: the same second step
        assert all(np.array_equal(v, w2[k]) for k, v in fresh.execute("get_weights").items())
    finally:
        fresh.kill()
    assert not marker.exists(), "a planted pickle ran"
    exported = {k: v.detach().numpy() for k, v in AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
                .state_dict().items()}
    assert all(np.array_equal(exported[k], w1[k]) for k in w1)
    # `trajflow export` of the sharded checkpoint, offline: the same model, and the planted pickles stay unread.
    from tests.test_export import assert_offline_export_equals

    assert_offline_export_equals(ck, {"path": str(tiny_model_dir)}, tmp_path / "hf", tmp_path / "offline", "fsdp2")
    assert not marker.exists(), "a planted pickle ran"


def test_lora_two_ranks_equal_one_process_resume_and_merged_final(ray_local, tiny_model_dir, one_rank_lora,
                                                                  tmp_path):
    """peft adapters sharded with their blocks: the adapters train as in one process, the base stays
    frozen, the reference policy is the base with adapters disabled, decoding on the sharded module
    matches, a checkpoint holds the adapters alone and resumes exactly, final/ is W + (alpha/r) B A."""
    from safetensors.numpy import load_file
    from transformers import AutoModelForCausalLM

    from tests.test_deepspeed_lora import GREEDY, LORA, PROMPTS, adapters, merged_by_hand

    ref = one_rank_lora
    group = spawn_fsdp(tiny_model_dir, model_cfg=LORA, kl_loss_coef=0.0)
    try:
        group.execute("update_actor", ref["b1"])
        w1 = group.execute("get_weights")
        assert_close(adapters(w1), adapters(ref["w1"]))
        assert all(np.array_equal(w1[k], ref["w0"][k]) for k in w1 if "lora_" not in k)  # the base stays frozen
        ref_logp = group.execute("compute_ref_log_prob", ref["b1"].rows.prompt_ids, ref["b1"].rows.response_ids)
        assert max(float(np.abs(a - b).max()) for a, b in zip(ref_logp, ref["ref_logp"])) < 1e-5
        assert group.execute("generate_sequences", PROMPTS, GREEDY).response_ids == ref["gen1"]
        group.execute("save_checkpoint", str(tmp_path / "ck"))
        group.execute("export_hf", str(tmp_path / "final"))
    finally:
        group.kill()
    exported = {k: v.detach().numpy() for k, v in AutoModelForCausalLM.from_pretrained(tmp_path / "final")
                .state_dict().items()}
    assert_close(exported, merged_by_hand(w1))
    saved = load_file(tmp_path / "final" / "adapter" / "adapter_model.safetensors")
    assert saved.keys() == {k.replace(".default", "") for k in adapters(w1)}
    from tests.test_export import assert_offline_export_equals

    lora_cfg = {"path": str(tiny_model_dir), **{k: getattr(LORA, k) for k in (
        "lora_rank", "lora_alpha", "lora_dropout", "lora_use_rslora", "target_modules")}}
    assert_offline_export_equals(tmp_path / "ck", lora_cfg, tmp_path / "final", tmp_path / "offline", "fsdp2",
                                 exact=False)
    # The checkpoint's shards are the adapters' alone: together exactly their elements, no base weight.
    shards = [load_file(tmp_path / "ck" / f"fsdp_rank{r:05d}.safetensors") for r in range(2)]
    held = [(k, v) for s in shards for k, v in s.items() if k.startswith("state.model.")]
    assert all("lora_" in k for k, _ in held)
    assert sum(v.size for _, v in held) == sum(v.size for v in adapters(ref["w0"]).values())

    fresh = spawn_fsdp(tiny_model_dir, model_cfg=LORA, kl_loss_coef=0.0)
    try:
        assert fresh.execute("load_checkpoint", str(tmp_path / "ck")) == {"policy_version": 1}
        assert all(np.array_equal(v, w1[k]) for k, v in fresh.execute("get_weights").items())
        fresh.execute("update_actor", ref["b2"])
        assert_close(adapters(fresh.execute("get_weights")), adapters(ref["w2"]))
    finally:
        fresh.kill()


def critic_batch(worker_values, seed: int, rows: int = 10):
    """Random rows, the critic's own pre-update values, returns = values + noise, a masked row."""
    from trajflow.stages.critic_update import CriticBatch, CriticRows, CriticSettings

    rng = np.random.default_rng(seed)
    prompts = [rng.integers(10, 2000, size=int(n)).tolist() for n in rng.integers(3, 14, size=rows)]
    resps = [rng.integers(10, 2000, size=int(n)).tolist() for n in rng.integers(1, 10, size=rows)]
    values = [v.tolist() for v in worker_values(prompts, resps)]
    returns = [(np.asarray(v) + rng.normal(size=len(v))).tolist() for v in values]
    mask = [[0.0 if i == 3 else 1.0] * len(r) for i, r in enumerate(resps)]
    return CriticBatch(CriticRows(prompts, resps, values, returns, loss_mask=mask), CriticSettings(mini_batch_rows=5))


def test_critic_two_ranks_equal_one_process_and_resume(ray_local, tiny_model_dir, tmp_path):
    """critic.strategy=fsdp2: the value model (LM body + head) sharded over 2 ranks makes the same
    two clipped-value-loss steps as the one-process critic (float32 tolerance as above), values are
    served by split calls, and a sharded checkpoint resumes to the same next step."""
    from trajflow.config import CriticConfig
    from trajflow.workers.critic import CriticWorker

    base = dict(lr=1e-3, ppo_micro_batch_size=2, cliprange_value=0.5, grad_clip=1.0)
    one = CriticWorker(str(tiny_model_dir), CriticConfig(**base), MODEL, num_threads=1)
    b1 = critic_batch(one.compute_values, 0)
    m1 = one.update_critic(b1)
    w1 = one.get_weights()
    b2 = critic_batch(one.compute_values, 1)
    m2 = one.update_critic(b2)
    w2 = one.get_weights()

    cfg = CriticConfig(**base, strategy="fsdp2")

    def spawn() -> WorkerGroup:
        g = WorkerGroup.spawn(CriticWorker, (str(tiny_model_dir), cfg, MODEL, "cpu", 1), [{"num_cpus": 0}] * 2,
                              "critic", lockstep=True)
        g.init_distributed()
        return g

    group = spawn()
    try:
        got1 = group.execute("update_critic", b1)
        assert_close(group.execute("get_weights"), w1)
        values = group.execute("compute_values", b2.rows.prompt_ids, b2.rows.response_ids)
        assert max(float(np.abs(np.asarray(a) - np.asarray(b)).max()) for a, b in zip(values, b2.rows.values)) < 1e-5
        group.execute("save_checkpoint", str(tmp_path / "critic"))
        got2 = group.execute("update_critic", b2)
        assert_close(group.execute("get_weights"), w2)
    finally:
        group.kill()
    for got, ref in ((got1, m1), (got2, m2)):
        for key in ("critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean", "critic/grad_norm"):
            assert got[key] == pytest.approx(ref[key], rel=1e-4, abs=1e-6), key
    fresh = spawn()
    try:
        fresh.execute("load_checkpoint", str(tmp_path / "critic"))
        fresh.execute("update_critic", b2)
        assert_close(fresh.execute("get_weights"), w2)
    finally:
        fresh.kill()


def test_reference_sharded_on_two_ranks_equals_one_process(ray_local, tiny_model_dir):
    """reference.strategy=fsdp2 (verl's ref on FSDP), with its parameters offloaded to host memory
    (verl's ``ref.fsdp_config.param_offload``): each of 2 ranks keeps half of the frozen model and the
    group serves the one-process reference worker's log-probs. A forward of the same full weights on
    other micro-batches: they agree to float32 rounding (1e-5; a wrong shard, row order or position
    shifts them by ~1e-1). The bf16 MixedPrecisionPolicy path is the actor's, tested above."""
    from trajflow.config.schema import FSDPConfig
    from trajflow.workers.reference import ReferenceWorker

    rng = np.random.default_rng(3)
    prompts = [rng.integers(10, 2000, size=int(n)).tolist() for n in rng.integers(3, 14, size=7)]
    resps = [rng.integers(10, 2000, size=int(n)).tolist() for n in rng.integers(1, 10, size=7)]
    one = ReferenceWorker(str(tiny_model_dir), MODEL, ROLLOUT, num_threads=1)
    want = one.compute_ref_log_prob(prompts, resps)
    whole = sum(p.numel() for p in one.model.parameters())
    group = WorkerGroup.spawn(ReferenceWorker, (str(tiny_model_dir), MODEL, ROLLOUT, "cpu", 1, None, "fsdp2",
                                                FSDPConfig(offload_params=True)),
                              [{"num_cpus": 0}] * 2, "reference", lockstep=True)
    try:
        group.init_distributed()
        held = group.execute("held_elements")
        got = group.execute("compute_ref_log_prob", prompts, resps)  # 7 rows: ranks get 4 and 3 (+1 padding row)
    finally:
        group.kill()
    assert sum(held) == whole and max(held) <= whole // 2 + 4096, (held, whole)  # dim-0 shards: ~half each
    assert [len(g) for g in got] == [len(r) for r in resps]
    worst = max(float(np.abs(np.asarray(a) - np.asarray(b)).max()) for a, b in zip(got, want))
    print(f"\nreference fsdp2 fp32: max |log-prob - one process| = {worst:.3g}")
    assert worst <= 1e-5, worst
