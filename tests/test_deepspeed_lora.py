"""LoRA under DeepSpeed data parallel (CPU, gloo): 2 ranks update the adapters as one process does,
and a checkpoint holds the adapters and their optimizer state without the frozen base.

Tolerance as in tests/test_deepspeed_ranks.py: the ranks differ from one process only in float
summation order of the all-reduced gradients.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.test_deepspeed_ranks import ACTOR, ROLLOUT, assert_close, make_batch
from trajflow.config import ActorConfig, ModelConfig
from trajflow.workers.group import WorkerGroup

LORA = ModelConfig(dtype="float32", lora_rank=4, lora_alpha=8, target_modules="all-linear")


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
    w.update_actor(b2)
    return {"b1": b1, "b2": b2, "w0": w0, "w1": w1, "w2": w.get_weights()}


def spawn_lora(model_dir, zero_stage: int = 2) -> WorkerGroup:
    from trajflow.workers.policy import PolicyWorker

    actor = ActorConfig(**{**ACTOR, "kl_loss_coef": 0.0, "strategy": "deepspeed", "zero_stage": zero_stage,
                           "world_size": 2})
    group = WorkerGroup.spawn(PolicyWorker, (str(model_dir), actor, LORA, ROLLOUT, 0, "cpu", 1),
                              [{"num_cpus": 0}] * 2, "actor")
    group.init_distributed()
    return group


def test_zero2_lora_two_ranks_equal_one_rank_and_resume(ray_local, tiny_model_dir, one_rank_lora, tmp_path):
    ref = one_rank_lora
    group = spawn_lora(tiny_model_dir)
    try:
        assert adapters(group.execute("get_weights")).keys() == adapters(ref["w0"]).keys() != set()
        group.execute("update_actor", ref["b1"])
        w1 = group.execute("get_weights")
        assert_close(adapters(w1), adapters(ref["w1"]))
        base = [k for k in w1 if "lora_" not in k]
        assert all(np.array_equal(w1[k], ref["w0"][k]) for k in base)  # the base stays frozen
        assert max(float(np.abs(w1[k] - ref["w0"][k]).max()) for k in adapters(w1)) > 1e-4
        group.execute("save_checkpoint", str(tmp_path / "ck"))
    finally:
        group.kill()
    import torch

    # Adapters and their optimizer state, not the frozen base (DeepSpeed keeps the tied
    # embedding's entry, lm_head.weight, whatever is frozen: it records shared parameters).
    module = torch.load(tmp_path / "ck" / "deepspeed" / "latest" / "mp_rank_00_model_states.pt",
                        weights_only=True)["module"]
    frozen = [k for k in module if "lora_" not in k]
    assert frozen == ["model.base_model.model.lm_head.weight"], frozen
    assert {k.replace("model.base_model.model.", "").replace(".default", "") for k in module if "lora_" in k} \
        == {k.replace("base_model.model.", "").replace(".default", "") for k in adapters(ref["w0"])}

    fresh = spawn_lora(tiny_model_dir)
    try:
        assert fresh.execute("load_checkpoint", str(tmp_path / "ck")) == {"policy_version": 1}
        assert all(np.array_equal(v, w1[k]) for k, v in fresh.execute("get_weights").items())
        fresh.execute("update_actor", ref["b2"])  # the optimizer state came back: the same second step
        assert_close(adapters(fresh.execute("get_weights")), adapters(ref["w2"]))
    finally:
        fresh.kill()


class _RunsCode:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


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
        state["ds_version"] = _RunsCode(str(marker))
        torch.save(state, shard)
        with pytest.raises(ray.exceptions.RayTaskError, match="weights_only|Unsupported global"):
            group.execute("load_checkpoint", str(tmp_path / "ck"))
        assert not marker.exists(), "the tampered shard ran code"
    finally:
        group.kill()
