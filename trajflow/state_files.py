"""Worker state on disk in formats that cannot run code: tensors in safetensors, the rest in JSON.

A checkpoint folder may come from anywhere (a copied run, a tampered one), so nothing a worker
reads back may be a pickle. :func:`save_state` splits a nested state (optimizer ``state_dict``, RNG
states, counters) into named tensors and a JSON tree that refers to them; :func:`load_state`
rebuilds it exactly (same dtypes and bytes, so a resumed run continues bit for bit).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trajflow.errors import StoreError

_TENSOR = "__tensor__"
_TUPLE = "__tuple__"
_INT_KEYS = "__int_keys__"


def save_state(state: dict[str, Any], directory: str | Path, name: str) -> list[Path]:
    """Write ``state`` as ``<name>.safetensors`` (every tensor) and ``<name>.json`` (everything else).

    Args:
        state: nested dicts/lists/tuples of tensors, numpy arrays, str, int, float, bool and None
            (dict keys str or int, as in ``optimizer.state_dict()``).
        directory: the folder to write into (created).
        name: the files' stem.

    Returns:
        The two files written.

    Raises:
        TypeError: a value of another type (it would need pickle).
    """
    from safetensors.torch import save_file

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}

    def encode(x: Any, path: str) -> Any:
        if isinstance(x, torch.Tensor):
            tensors[path] = x.detach().cpu().contiguous().clone()
            return {_TENSOR: path}
        if isinstance(x, np.ndarray):
            return {_TENSOR: path, "numpy": True, **_save_numpy(x, path, tensors)}
        if isinstance(x, dict):
            int_keys = all(isinstance(k, int) for k in x) and bool(x)
            if not int_keys and not all(isinstance(k, str) for k in x):
                raise TypeError(f"state {path}: dict keys must all be str or all int")
            out = {str(k): encode(v, f"{path}.{k}") for k, v in x.items()}
            return {_INT_KEYS: out} if int_keys else out
        if isinstance(x, tuple):
            return {_TUPLE: [encode(v, f"{path}.{i}") for i, v in enumerate(x)]}
        if isinstance(x, list):
            return [encode(v, f"{path}.{i}") for i, v in enumerate(x)]
        if isinstance(x, (np.integer, np.floating, np.bool_)):
            return x.item()
        if x is None or isinstance(x, (str, bool, int, float)):
            return x
        raise TypeError(f"state {path}: {type(x).__name__} cannot be stored without pickle")

    tree = encode(state, "state")
    files = [d / f"{name}.safetensors", d / f"{name}.json"]
    save_file(tensors, str(files[0]))
    files[1].write_text(json.dumps(tree))
    return files


def _save_numpy(x: np.ndarray, path: str, tensors: dict[str, torch.Tensor]) -> dict:
    # numpy dtypes torch lacks (uint32: numpy's MT19937 key) travel as their bytes.
    tensors[path] = torch.from_numpy(np.frombuffer(np.ascontiguousarray(x).tobytes(), dtype=np.uint8).copy())
    return {"dtype": x.dtype.str, "shape": list(x.shape)}


def load_state(directory: str | Path, name: str) -> dict[str, Any]:
    """Read what :func:`save_state` wrote; no code is imported or run.

    Raises:
        StoreError: a file is missing or unreadable (names it).
    """
    from safetensors.torch import load_file

    d = Path(directory)
    st, js = d / f"{name}.safetensors", d / f"{name}.json"
    try:
        tensors = load_file(str(st))
        tree = json.loads(js.read_text())
    except FileNotFoundError as e:
        raise StoreError(f"checkpoint file {e.filename} is missing") from None
    except Exception as e:  # a truncated or garbled file: name it, not the library's internals
        raise StoreError(f"checkpoint state {st} / {js} is unreadable: {type(e).__name__}: {e}") from None

    def decode(x: Any) -> Any:
        if isinstance(x, dict):
            if _TENSOR in x:
                t = tensors[x[_TENSOR]]
                if x.get("numpy"):
                    return np.frombuffer(t.numpy().tobytes(), dtype=np.dtype(x["dtype"])).reshape(x["shape"]).copy()
                return t
            if _TUPLE in x:
                return tuple(decode(v) for v in x[_TUPLE])
            if _INT_KEYS in x:
                return {int(k): decode(v) for k, v in x[_INT_KEYS].items()}
            return {k: decode(v) for k, v in x.items()}
        if isinstance(x, list):
            return [decode(v) for v in x]
        return x

    return decode(tree)


def rng_state() -> dict[str, Any]:
    """This process's torch, numpy and Python RNG states (what a checkpoint restores)."""
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}


def set_rng_state(rng: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` returned (after a round trip through :func:`load_state`)."""
    torch.set_rng_state(rng["torch"])
    np.random.set_state(tuple(rng["numpy"]))
    version, internal, gauss = rng["python"]
    random.setstate((version, tuple(internal), gauss))
