"""Shared fixtures: a tiny random-weight model around the real SmolLM2 tokenizer, a real local Ray."""

from __future__ import annotations

from trajflow.infra.env import configure_environment

configure_environment()

import os  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

REPO = Path(__file__).resolve().parents[1]

# The default recipe's precision is 'auto' (bf16 on AMX/AVX512-BF16 CPUs): pin it to float32 so every
# test, subprocess CLI runs included, computes the same on every machine. Tests of 'auto' unset it.
os.environ["TRAJFLOW_AUTO_PRECISION"] = "float32"


def pytest_sessionfinish(session, exitstatus):
    """Stop Prefect's temporary API server while pytest's output streams are still open: left to its
    own exit hook, it logs "Stopping temporary server" into the closed capture stream (a logging
    traceback after the test summary)."""
    import sys

    server = sys.modules.get("prefect.server.api.server")
    for instance in list(getattr(getattr(server, "SubprocessASGIServer", None), "_instances", {}).values()):
        instance.stop()


def make_tiny_model(out: Path, seed: int = 0, **config) -> Path:
    """A 2-layer Llama with SmolLM2's tokenizer and random weights (~1.7M parameters); ``config``
    overrides LlamaConfig fields (sizes, layers, vocabulary)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from trajflow.models import builtin_tokenizer_dir

    tok = AutoTokenizer.from_pretrained(builtin_tokenizer_dir("smollm2-135m-instruct"))
    torch.manual_seed(seed)
    fields = dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
                  tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                  pad_token_id=tok.pad_token_id)
    model = LlamaForCausalLM(LlamaConfig(**{**fields, **config}))
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def ray_local():
    """One real local Ray for the whole session (``ray.init`` costs ~6 s)."""
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=max(2, os.cpu_count() or 2), include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def tiny_overrides(model_dir: Path, store_root: Path, **extra) -> list[str]:
    """Overrides that make the default recipe run in seconds with the tiny model."""
    base = {
        "model.path": str(model_dir),
        "store.root": str(store_root),
        "data.train_batch_size": 2,
        "data.val_max_prompts": 4,
        "rollout.n": 2,
        "rollout.max_new_tokens": 8,
        "actor.ppo_mini_batch_size": 2,
        "actor.ppo_micro_batch_size": 2,
        "trainer.total_iterations": 2,
        "trainer.test_freq": 1,
        "trainer.save_freq": 1,
        "trainer.max_checkpoints": 2,  # the tests were written against this rotation (the default keeps 1)
        "trainer.progress": False,
        "trainer.log_samples": 2,
        "gates.enabled": False,
        # The default recipe's 16-token overlong buffer does not fit the 8-token cap; dapo's tests turn it on.
        "reward.overlong_buffer.enable": False,
        # Pinned, so a test computes the same on every machine (the default recipe may say 'auto').
        "actor.mixed_precision.param_dtype": "float32",
        "rollout.dtype": "float32",
    }
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]
