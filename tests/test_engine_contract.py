"""The rollout-engine contract (trajflow/engines/base.py): declared weight-sync capabilities chosen once,
the registry by name, and a policy worker that calls only what an engine declares."""

from pathlib import Path

import pytest
import torch

from trajflow.stages.policy_update import UpdateBatch, UpdateRows, UpdateSettings
from trajflow.stages.rollout import SamplingParams
from trajflow.config import ActorConfig, ModelConfig, RolloutConfig
from trajflow.engines.base import (EngineError, GenerationOutput, LogprobKind, RolloutEngine, WeightSync,
                                   choose_weight_sync)
from trajflow.engines.hf import HFRolloutEngine
from trajflow.engines.registry import ENGINES, make_engine, register_engine
from trajflow.engines.remote import RemoteRolloutEngine
from trajflow.engines.vllm import VLLMRolloutEngine

from tests.test_policy_worker import ACTOR


class _Declares(RolloutEngine):
    def generate(self, prompt_ids, params):
        raise NotImplementedError


def _engine(*caps):
    return type("E", (_Declares,), {"weight_sync": tuple(caps)})()


@pytest.mark.parametrize("caps, lora, chosen", [
    ((WeightSync.SHARED, WeightSync.FULL), False, WeightSync.SHARED),
    ((WeightSync.SHARED, WeightSync.FULL), True, WeightSync.SHARED),  # the hf engine samples the adapted module
    ((WeightSync.FULL, WeightSync.ADAPTER), False, WeightSync.FULL),
    ((WeightSync.FULL, WeightSync.ADAPTER), True, WeightSync.ADAPTER),  # only the adapter travels
    ((WeightSync.PATH,), True, WeightSync.PATH),
    ((WeightSync.PATH, WeightSync.FULL), False, WeightSync.PATH),  # the engine's own order of preference
])
def test_the_weight_sync_is_chosen_once_from_what_the_engine_declares(caps, lora, chosen):
    assert choose_weight_sync(_engine(*caps), lora) is chosen


def test_an_engine_without_a_usable_weight_sync_is_refused():
    with pytest.raises(EngineError, match=r"declares no weight sync .*\['adapter'\], lora=False"):
        choose_weight_sync(_engine(WeightSync.ADAPTER), lora=False)
    with pytest.raises(EngineError):
        choose_weight_sync(_engine(), lora=True)


def test_the_builtin_engines_declare_their_contract():
    assert HFRolloutEngine.weight_sync == (WeightSync.SHARED, WeightSync.FULL)
    assert HFRolloutEngine.logprob_kind is LogprobKind.RAW
    assert VLLMRolloutEngine.weight_sync == (WeightSync.FULL, WeightSync.ADAPTER)
    assert VLLMRolloutEngine.logprob_kind is LogprobKind.RAW  # none returned under a top-k / top-p filter
    assert RemoteRolloutEngine.weight_sync == (WeightSync.FULL,) and RemoteRolloutEngine.weights_from_rank0
    assert not HFRolloutEngine.weights_from_rank0 and not VLLMRolloutEngine.weights_from_rank0
    # An undeclared capability is an error, not a silent no-op.
    with pytest.raises(NotImplementedError, match="does not declare WeightSync.ADAPTER"):
        _engine(WeightSync.FULL).update_adapter({}, None, 1)
    assert sorted(ENGINES) == ["hf", "vllm"] and ENGINES["hf"].shares_module and not ENGINES["vllm"].shares_module


def test_an_unknown_engine_names_the_registered_ones():
    with pytest.raises(ValueError, match=r"rollout.engine='sglang' is not a registered engine; choose one of hf, vllm"):
        make_engine("sglang", None)


class _Recording(RolloutEngine):
    """An engine that samples token 7 until the cap and records every contract call."""

    logprob_kind = LogprobKind.RAW

    def __init__(self, caps):
        self.weight_sync = caps
        self.calls = []

    def generate(self, prompt_ids, params):
        self.calls.append("generate")
        rows = len(prompt_ids) * params.n
        return GenerationOutput([[7] * params.max_new_tokens for _ in range(rows)], ["length"] * rows,
                                [[-1.0] * params.max_new_tokens for _ in range(rows)])

    def update_weights(self, named_tensors, version=None):
        self.calls.append(("full", sorted(named_tensors)[:1], version))

    def load_weights_from_path(self, path, version=None):
        files = sorted(p.name for p in Path(path).iterdir())
        self.calls.append(("path", "config.json" in files and any(f.endswith(".safetensors") for f in files), version))

    def sleep(self):
        self.calls.append("sleep")

    def wake_up(self, gathered=None):
        self.calls.append("wake_up")


@pytest.mark.parametrize("caps, pushed", [((WeightSync.FULL,), "full"), ((WeightSync.PATH,), "path")])
def test_the_policy_worker_calls_only_the_contract_and_the_chosen_sync(tiny_model_dir, caps, pushed):
    from trajflow.workers.policy import PolicyWorker

    name = f"test-recording-{pushed}"
    register_engine(name)(lambda ctx: _Recording(caps))
    try:
        w = PolicyWorker(str(tiny_model_dir), ActorConfig(**ACTOR), ModelConfig(dtype="float32"),
                         RolloutConfig(micro_batch_size=4, temperature=0.7, engine=name), seed=0, num_threads=1)
        engine = w.engine
        assert isinstance(engine, _Recording) and w.weight_sync is caps[0]
        prompts = [[1, 2, 3], [4, 5]]
        out = w.generate_sequences(prompts, SamplingParams(n=2, temperature=0.7, max_new_tokens=3, seed=1))
        assert out.rollout_logprobs == [[-1.0] * 3] * 4  # the engine's own, not recomputed
        assert engine.calls == ["wake_up", "generate", "sleep"]
        engine.calls.clear()
        rows = [p for p in prompts for _ in range(2)]
        adv = [[1.0, 1.0, 1.0], [-1.0] * 3, [1.0] * 3, [-1.0] * 3]
        w.update_actor(UpdateBatch(UpdateRows(rows, out.response_ids, out.rollout_logprobs, adv), UpdateSettings(4)))
        expected = ("full", [sorted(w.model.state_dict())[0]], 1) if pushed == "full" else ("path", True, 1)
        assert engine.calls == ["sleep", expected]
        assert w.policy_version == 1
    finally:
        ENGINES.pop(name, None)


def test_the_hf_engine_sleeps_and_wakes_its_cast_copy(tiny_model_dir):
    from trajflow.modeling.packed_linear import dense_parameters
    from trajflow.models import load_causal_lm

    model = load_causal_lm(str(tiny_model_dir), "float32", "cpu")
    eng = HFRolloutEngine(model, 0, [2], 4, "cpu", dtype="bfloat16")
    assert eng.own_copy
    eng.sleep()
    assert all(p.numel() == 0 for p in eng.model.parameters())
    eng.wake_up()
    src = dict(model.named_parameters())
    # The weights as the copy's layers use them (a bf16 linear's may live in its oneDNN-packed copy).
    for name, p in dense_parameters(eng.model).items():
        assert torch.equal(p, src[name].detach().to(torch.bfloat16)), name
    shared = HFRolloutEngine(model, 0, [2], 4, "cpu")
    shared.sleep()  # nothing of its own to release
    assert shared.model is model and all(p.numel() > 0 for p in model.parameters())
