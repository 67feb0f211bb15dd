"""Weights out of FSDP2 shards one transformer block at a time (2 gloo ranks as Ray actors).

What a rank materialises during a weight sync is measured, not inferred from the code: the sync runs
under ``torch.profiler`` with ``profile_memory=True``, whose ``[memory]`` events are every CPU
allocation and free (bytes) in order; their running sum's maximum is the most memory the sync held
at once beyond what the rank held before. The model is deep and narrow-vocabulary (8 blocks, each
about as large as the embedding matrix), so one block is ~1/9 of the model and gathering the whole
model (what ``gathered()`` does) is told apart from gathering it block by block by a factor of ~3 or more.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tests.test_deepspeed_ranks import ACTOR, make_batch
from tests.test_fsdp_ranks import actor_config
from trajflow.config import ModelConfig, RolloutConfig
from trajflow.workers.group import WorkerGroup
from trajflow.workers.policy import PolicyWorker

LAYERS = 8
FP32 = ModelConfig(dtype="float32")
LORA = ModelConfig(dtype="float32", lora_rank=4, lora_alpha=8, target_modules="all-linear")
#: Sampling from a bfloat16 copy of the weights: the copy the hf engine casts after every update.
BF16_ROLLOUT = RolloutConfig(micro_batch_size=4, temperature=1.0, dtype="bfloat16")
FP32_ROLLOUT = RolloutConfig(micro_batch_size=4, temperature=1.0)


def peak_bytes(fn) -> tuple[int, int]:
    """``(peak, net)``: the largest running sum of the CPU allocator's allocations minus frees while
    ``fn()`` runs, and the sum at its end (what it kept)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    running = peak = 0
    for _, n in events:
        running += n
        peak = max(peak, running)
    return peak, running


class MeteredPolicyWorker(PolicyWorker):
    """A policy rank that measures its own weight syncs (:func:`peak_bytes`) and counts the bytes of
    every ``update_weights`` call its engine receives.

    The hf engine's bf16 copy keeps plain weights here (no oneDNN packing): a packed copy is made
    anew at every sync after the old one is freed, and the profiler that meters the sync cannot see
    the free of a block allocated before it started, so it would count every packed layer as held.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if hasattr(self.engine, "pack_weights"):
            self.engine.pack_weights = False
            self.engine._unpack(restore=True)

    def metered_push(self) -> dict:
        calls: list[int] = []
        update = self.engine.update_weights

        def counting(named, version=None):
            calls.append(sum(t.numel() * t.element_size() for t in named.values()))
            return update(named, version=version)

        self.engine.update_weights = counting
        try:
            peak, net = peak_bytes(self._push_weights)
        finally:
            del self.engine.update_weights
        return {"peak": peak, "net": net, "calls": calls}

    def engine_copy(self) -> dict:
        """The hf engine's own copy (rollout.dtype), as float32 numpy arrays."""
        from trajflow.modeling.packed_linear import dense_state_dict

        # A packed bf16 linear's weight is read back from its packed copy.
        return {k: v.detach().float().numpy().copy() for k, v in dense_state_dict(self.engine.model).items()}


@pytest.fixture(scope="module")
def deep_model_dir(tmp_path_factory) -> Path:
    """8 Llama blocks of 0.26 M parameters each and a tied 2,048 x 128 embedding (0.26 M) with
    SmolLM2's tokenizer (its special tokens are below 2,048; prompts here are token ids < 2,000)."""
    from tests.conftest import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("deep-model"), vocab_size=2048, hidden_size=128,
                           intermediate_size=512, num_hidden_layers=LAYERS, num_attention_heads=4,
                           num_key_value_heads=4, max_position_embeddings=256)


def sizes(model_dir: Path) -> dict:
    """Bytes (float32) of the whole model (the tied head once) and of each bucket in the order of the
    model's ``state_dict`` (the tied head under both names): a block, or a run of tensors outside
    every block (the embedding; the final norm with the head)."""
    from transformers import AutoModelForCausalLM

    from trajflow.modeling.buckets import block_of

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    buckets: list[int] = []
    last = object()
    for name, t in model.state_dict().items():
        if block_of(name) != last:
            buckets.append(0)
        last = block_of(name)
        buckets[-1] += t.numel() * 4
    return {"model": sum(p.numel() * 4 for p in model.parameters()), "bucket": max(buckets), "buckets": buckets}


def spawn(model_dir, model_cfg, rollout) -> WorkerGroup:
    actor = actor_config(strategy="fsdp2", world_size=2, kl_loss_coef=0.0)
    group = WorkerGroup.spawn(MeteredPolicyWorker, (str(model_dir), actor, model_cfg, rollout, 0, "cpu", 1),
                              [{"num_cpus": 0}] * 2, "actor", lockstep=True)
    group.init_distributed()
    return group


def test_weights_leave_the_shards_one_block_at_a_time(ray_local, deep_model_dir):
    """LoRA on 2 FSDP2 ranks, measured in two syncs of one group.

    1. rollout.dtype=bfloat16 on the hf engine: after an update each rank casts its bf16 copy (of the
       peft model) from the shards, one gathered block at a time, holding a few buckets beyond the
       copy (gathering all blocks first, as ``gathered()`` does, holds the whole model: 9 buckets
       here); the copies are the trained weights rounded to bf16.
    2. Separate rollout worker attached: rank 0 sends W + (alpha/r) B A block by block, one
       update_weights call per bucket, exactly the bucket's bytes, holding a few buckets (merging
       the whole model first held all of it); rank 1 sends nothing; the rollout worker
       then holds exactly the merged weights, computed here from the gathered ones.
    """
    from trajflow.checkpoint import state_digest
    from trajflow.workers.rollout import RolloutWorker

    size = sizes(deep_model_dir)
    assert size["model"] >= 8 * size["bucket"]  # the set-up this test needs: no bucket dominates
    assert len(size["buckets"]) == LAYERS + 2
    # The bucket being assembled, plus gloo's two copies of the tensor being gathered (a chunk per
    # rank, then their concatenation), plus what Ray's threads allocate meanwhile: measured 2.0-3.0
    # buckets. Gathering the whole model at once holds at least the model: 9 buckets.
    budget = int(3.5 * size["bucket"])
    rollout = WorkerGroup.spawn(RolloutWorker, (str(deep_model_dir), FP32_ROLLOUT, FP32, 0, "cpu", 1),
                                [{"num_cpus": 0}], "rollout")
    group = spawn(deep_model_dir, LORA, BF16_ROLLOUT)
    try:
        group.execute("update_actor", make_batch(_one(deep_model_dir), 0))
        cast = group.execute("metered_push", mode="gather")
        copy = group.execute("engine_copy", mode="gather")
        weights = group.execute("get_weights")
        group.execute("attach_rollout", rollout.handles)
        merged_sync = group.execute("metered_push", mode="gather")
        digest = rollout.execute("weights_digest")
    finally:
        group.kill()
        rollout.kill()
    mib = 2**20
    print(f"\nmodel {size['model'] / mib:.2f} MiB fp32, largest bucket {size['bucket'] / mib:.2f} MiB; peak held "
          f"during the bf16 cast {[round(m['peak'] / mib, 2) for m in cast]} MiB, during the merged sync "
          f"{[round(m['peak'] / mib, 2) for m in merged_sync]} MiB (ranks 0, 1)")
    for rank in range(2):
        assert cast[rank]["peak"] <= budget, (rank, cast[rank]["peak"], budget)
        assert merged_sync[rank]["peak"] <= budget, (rank, merged_sync[rank]["peak"], budget)
        assert cast[rank]["calls"] == []  # the cast reads the buckets itself
        for k, v in weights.items():  # both ranks' copies: the trained weights rounded to bf16
            if k in copy[rank]:
                assert np.array_equal(copy[rank][k], torch.from_numpy(v).to(torch.bfloat16).float().numpy()), k
    assert sum(k in copy[0] for k in weights) >= len(copy[0]) - 1  # every tensor of the copy was compared
    assert merged_sync[0]["calls"] == size["buckets"]  # one call per bucket, each exactly that bucket
    assert merged_sync[1]["calls"] == []  # only rank 0 sends to separate rollout workers
    scale = LORA.lora_alpha / LORA.lora_rank
    merged = {}
    for k, v in weights.items():
        if "lora_" in k:
            continue
        w = torch.from_numpy(v)
        if k.endswith(".base_layer.weight"):
            stem = k[:-len(".base_layer.weight")]
            a, b = (torch.from_numpy(weights[f"{stem}.lora_{x}.default.weight"]) for x in "AB")
            w = w + (b @ a) * scale  # peft's merge: W + B A s
        merged[k.replace("base_model.model.", "", 1).replace(".base_layer.", ".")] = w
    assert any(np.abs(weights[k]).max() > 0 for k in weights if "lora_B" in k)  # the update moved B
    assert digest == state_digest(merged)


_ONE: dict = {}


def _one(model_dir) -> PolicyWorker:
    """A one-process worker on the deep model, for its batches' on-policy log-probs."""
    key = str(model_dir)
    if key not in _ONE:
        _ONE[key] = PolicyWorker(key, actor_config(kl_loss_coef=0.0), FP32, FP32_ROLLOUT, seed=0, num_threads=1)
    return _ONE[key]
