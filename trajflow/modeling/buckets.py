"""Weights out of sharded parameters, one transformer block (bucket) at a time.

A rollout engine that holds its own weights (a separate rollout worker, vLLM, the ``hf`` engine's
copy in ``rollout.dtype``) needs the whole tensors, but a data-parallel rank keeps only shards of
them (FSDP2, ZeRO-3). Gathering the whole model at once would put a full copy in memory on a rank
beside its shards, which is what sharding avoided; so the weights leave in buckets: all tensors
of one transformer block (``model.layers.<i>.``), and the tensors outside any block (embeddings,
final norm, head) in buckets of their own. The largest bucket is the largest of a block and the
embedding matrix, whatever the depth of the model (verl and OpenRLHF sync layer by layer, too).
"""

from __future__ import annotations

import re
from typing import Callable, Iterable, Iterator

import torch

#: The part of a parameter name that says which transformer block it belongs to.
_BLOCK = re.compile(r"^(.*?\.layers\.\d+)\.")


def block_of(name: str) -> str | None:
    """The block a parameter belongs to (``model.layers.3`` for ``model.layers.3.mlp.up_proj.weight``;
    peft's ``base_model.model.`` prefix kept), or None for one outside every block."""
    m = _BLOCK.match(name)
    return m.group(1) if m else None


def by_block(named: Iterable[tuple[str, Callable[[], torch.Tensor | None]]],
             keep: bool = True) -> Iterator[dict[str, torch.Tensor] | None]:
    """Group ``(name, produce)`` pairs, in order, into one dict per block.

    ``produce()`` is called only when its entry is reached, so a caller that gathers a tensor there
    holds at most the current bucket at once, provided nothing holds the previous one when the next
    is asked for: the consumer drops it first (``del``), and a generator that passes the buckets on
    does so with ``yield from`` (a loop variable would keep the previous bucket alive while the next
    one is gathered).

    Args:
        named: ``(name, produce)``; ``produce()`` returns the tensor (None: nothing to keep).
        keep: False for a rank that only takes part in the gathering: it gets None per bucket.

    Yields:
        ``{name: tensor}`` per block, or None when not ``keep`` (every rank yields equally many times).
    """
    bucket: dict[str, torch.Tensor] = {}
    current: object = object()  # no block yet
    started = False
    for name, produce in named:
        block = block_of(name)
        if started and block != current:
            yield bucket if keep else None
            bucket = {}
        current, started = block, True
        t = produce()
        if t is not None:
            bucket[name] = t
        del t  # else it would hold a block's last tensor while the next block is gathered
    if started:
        yield bucket if keep else None

