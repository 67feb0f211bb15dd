"""Built-in models and prompt formats: GGUF assembly from part packages, the sha256 check, the
one-line errors, exactly one BOS, and the stop ids of the real Gemma 3 270M base model."""

from __future__ import annotations

import hashlib
import importlib.util
import sys

import pytest

from trajflow import models
from trajflow.errors import ModelLoadError
from trajflow.models import BUILTIN_MODELS, BuiltinModel

GEMMA_INSTALL = BUILTIN_MODELS["gemma3-270m"].install
HAVE_GEMMA = all(importlib.util.find_spec(p) is not None
                 for p in [BUILTIN_MODELS["gemma3-270m"].package] + [p for p, _ in BUILTIN_MODELS["gemma3-270m"].parts])
needs_gemma = pytest.mark.skipif(not HAVE_GEMMA, reason=f"Gemma 3 270M is not installed: {GEMMA_INSTALL}")

MESSAGES = [{"role": "system", "content": "Solve the arithmetic problem."},
            {"role": "user", "content": "Calculate 3 + 5."},
            {"role": "assistant", "content": "3 + 5 = 8\nAnswer: 8"},
            {"role": "user", "content": "Calculate 12 + 30."}]


def _fake_parted_model(tmp_path, monkeypatch, pieces: list[bytes], declared: str) -> None:
    """A built-in ``fake-model`` whose GGUF is split over two importable part packages."""
    root = tmp_path / "site"
    (root / "fake_gguf").mkdir(parents=True)
    (root / "fake_gguf" / "__init__.py").write_text(f"EXPECTED_SHA256 = {declared!r}\n")
    parts = []
    for i, data in enumerate(pieces):
        pkg = root / f"fake_gguf_part{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("")
        (pkg / "data" / f"m.gguf.part{i:02d}").write_bytes(data)
        parts.append((f"fake_gguf_part{i}", f"data/m.gguf.part{i:02d}"))
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.setitem(BUILTIN_MODELS, "fake-model",
                        BuiltinModel("fake_gguf", "m.gguf", "pip install fake-gguf==1.0", parts=tuple(parts)))


def test_parts_concatenate_to_the_declared_file(tmp_path, monkeypatch):
    pieces = [b"GGUF" + b"a" * 1000, b"b" * 777]
    _fake_parted_model(tmp_path, monkeypatch, pieces, hashlib.sha256(b"".join(pieces)).hexdigest())
    work = tmp_path / "work"
    work.mkdir()
    assert models._gguf_file("fake-model", work).read_bytes() == b"".join(pieces)


def test_parts_with_another_sha256_are_one_line_naming_the_install(tmp_path, monkeypatch):
    _fake_parted_model(tmp_path, monkeypatch, [b"x", b"y"], "0" * 64)
    (tmp_path / "work").mkdir()
    with pytest.raises(ModelLoadError) as e:
        models._gguf_file("fake-model", tmp_path / "work")
    assert "\n" not in str(e.value) and "sha256" in str(e.value) and "pip install fake-gguf==1.0" in str(e.value)


def test_missing_packages_are_one_line_naming_the_pip_command(tmp_path, monkeypatch):
    monkeypatch.setitem(BUILTIN_MODELS, "gemma3-270m", BuiltinModel(
        "no_such_gguf_pkg", "m.gguf", GEMMA_INSTALL, parts=(("no_such_gguf_part1", "data/m.part00"),)))
    with pytest.raises(ModelLoadError) as e:
        models.resolve_model_path("gemma3-270m", cache_dir=str(tmp_path))
    msg = str(e.value)
    assert "\n" not in msg and "model.path='gemma3-270m'" in msg and GEMMA_INSTALL in msg
    assert not (tmp_path / "gemma3-270m").exists() and not list(tmp_path.glob(".gemma3-270m-*"))


def test_completion_prompt_is_a_few_shot_document_without_role_names():
    assert models.completion_prompt(MESSAGES) == (
        "Solve the arithmetic problem.\n\nCalculate 3 + 5.\n3 + 5 = 8\nAnswer: 8\n\nCalculate 12 + 30.\n")


def test_unknown_prompt_format_is_refused():
    with pytest.raises(ValueError, match="prompt_format='chatml'"):
        models.chat_prompt_ids(None, MESSAGES, "chatml")


def test_gemma3_recipe_uses_the_builtin_in_the_completion_format():
    from trajflow.config import load_config

    cfg = load_config("grpo_gemma3")
    assert cfg.model.path == "gemma3-270m" and cfg.model.prompt_format == "completion"
    # A stop at the blank line must leave room for the worked answer ("37 + 58 = 95\nAnswer: 95").
    assert cfg.rollout.max_new_tokens >= 20


@pytest.fixture(scope="module")
def gemma_dir():
    # Converted once per cache (~40 s the first time), then read from it.
    return models.resolve_model_path("gemma3-270m")


@needs_gemma
def test_gemma3_builtin_is_converted_to_safetensors_with_its_config(gemma_dir):
    config = models.check_causal_lm(gemma_dir)
    assert list(gemma_dir.glob("*.safetensors"))
    assert config.model_type == "gemma3_text" and config.vocab_size == 262144
    assert config.sliding_window == 512
    assert config.layer_types.count("sliding_attention") * 6 == 5 * len(config.layer_types)
    assert models.resolve_model_path("gemma3-270m") == gemma_dir  # cached: no second conversion


@needs_gemma
@pytest.mark.parametrize("fmt", ["auto", "plain", "completion"])
def test_gemma3_prompts_start_with_exactly_one_bos(gemma_dir, fmt):
    tok = models.load_tokenizer(gemma_dir)
    assert tok.chat_template is None and tok.bos_token == "<bos>"
    ids = models.chat_prompt_ids(tok, MESSAGES, fmt)
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1


@needs_gemma
def test_gemma3_stops_at_eos_end_of_turn_and_after_its_answer(gemma_dir):
    import torch

    tok = models.load_tokenizer(gemma_dir)
    model = models.load_causal_lm(gemma_dir)
    vocab = tok.get_vocab()
    sep = tok("\n\n", add_special_tokens=False)["input_ids"]
    assert models.eos_token_ids(tok, model.generation_config) == sorted({tok.eos_token_id, vocab["<end_of_turn>"]})
    stops = models.eos_token_ids(tok, model.generation_config, "completion")
    assert len(sep) == 1 and {tok.eos_token_id, vocab["<end_of_turn>"], *sep} <= set(stops)
    assert tok("\n\n\n\n", add_special_tokens=False)["input_ids"][0] in stops
    assert tok("\n", add_special_tokens=False)["input_ids"][0] not in stops  # lines inside an answer
    assert tok.pad_token_id not in stops
    # Greedy, the base model answers in the worked example's shape and then stops at the blank line.
    ids = models.chat_prompt_ids(tok, MESSAGES, "completion")
    torch.set_num_threads(min(2, torch.get_num_threads()))
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, eos_token_id=stops,
                             pad_token_id=tok.pad_token_id)
    response = out[0, len(ids):].tolist()
    assert response[-1] in stops and len(response) < 24
    assert "Answer:" in tok.decode(response), tok.decode(response)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


@pytest.mark.parametrize("fmt", ["auto", "plain", "completion"])
def test_preflight_prompt_lengths_equal_the_ids_the_policy_builds(tiny_model_dir, fmt):
    """Preflight measures all prompts in one batch; each length is that of the prompt the policy
    worker tokenizes one by one (chat template, BOS handling and all)."""
    from transformers import AutoTokenizer

    from trajflow.models import chat_prompt_ids, prompt_lengths

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompts = [[{"role": "user", "content": "What is 12 + 30?"}],
               [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": "7 * 6 = ?"}],
               [{"role": "system", "content": "Solve."}, {"role": "user", "content": "1 + 1"},
                {"role": "assistant", "content": "2"}, {"role": "user", "content": "2 + 2"}]]
    assert prompt_lengths(tok, prompts, fmt) == [len(chat_prompt_ids(tok, p, fmt)) for p in prompts]
