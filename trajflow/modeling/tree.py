"""Tree packing: a micro-batch's prompts and responses as one sequence, one decoder call::

    [common prefix | prompt 1's rest, its rows' responses | ... | prompt k's rest, its rows' responses]

with per-path position ids and a tree attention mask, so each distinct prompt token is computed once
and every linear layer runs one matmul over the micro-batch's tokens. Attention runs block by block
(:func:`tree_attention_forward`); ``docs/scaling.md`` ("Model compute") explains why.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

from trajflow.modeling.packing import PackedBatch

# Longest packed sequence run as one decoder call. The tree builds a dense (N, N) mask (kept for
# SDPA under activation checkpointing) and each attention block is dense over its prompt's rows;
# past this length (long prompts or responses, large micro-batches) the cached-prompt path of
# trajflow.modeling.forward, whose attention is exact per row, is used.
TREE_MAX_TOKENS = 2048


@dataclass
class TreePacking:
    """A micro-batch packed as a prompt tree plus responses; see the module doc.

    A response contributes its first ``l - 1`` tokens (the inputs that predict tokens ``1 .. l - 1``;
    token 0 is predicted by its prompt's last token). Each token sees, causally, its own segment and
    its ancestors: a prompt's rest sees the prefix; a response sees the prefix and its own prompt's
    rest. Position ids restart per path, so every token sits at the position it has in its own row
    ``prompt + response``.

    Attributes:
        input_ids: ``(1, N)`` int64.
        position_ids: ``(1, N)`` int64.
        attention_mask: ``(1, 1, N, N)`` bool, True where a query (row) may attend to a key (column).
        source: ``(R,)`` int64: for each real response token of the micro-batch, in row-major order
            (the order of ``packed.response_mask.nonzero()``), the packed position whose hidden
            state predicts it.
        common: ``c``, the length of the shared prefix (positions ``0 .. c - 1``; 0 if none).
        blocks: ``(start, end)`` per distinct prompt: its rest followed by its rows' responses.
        block_masks: per block, ``(1, 1, end - start, c + end - start)`` bool: the block's queries
            against the prefix's keys then the block's own.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor
    source: torch.Tensor
    common: int = 0
    blocks: tuple = ()
    block_masks: tuple = ()

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])


def common_prefix_length(prompts: Sequence[Sequence[int]]) -> int:
    """Longest prefix shared by all ``prompts`` (at least two), stopping one token short of the
    shortest so that every prompt keeps a token of its own; 0 for fewer than two prompts."""
    if len(prompts) < 2:
        return 0
    shortest = min(len(p) for p in prompts)
    first = prompts[0]
    c = 0
    while c < shortest - 1 and all(p[c] == first[c] for p in prompts):
        c += 1
    return c


def _row_prompts(packed: PackedBatch) -> list[tuple[int, ...]]:
    P = packed.prompt_width
    lens = packed.attention_mask[:, :P].sum(-1).tolist()
    rows = packed.input_ids.tolist()
    return [tuple(rows[i][P - n:P]) for i, n in enumerate(lens)]


def tree_packed_tokens(packed: PackedBatch) -> int:
    """Length ``N`` of :func:`tree_pack`'s sequence for ``packed``, without building it."""
    distinct = list(dict.fromkeys(_row_prompts(packed)))
    c = common_prefix_length(distinct)
    resp = int((packed.response_mask.sum(-1) - 1).clamp(min=0).sum())
    return c + sum(len(p) - c for p in distinct) + resp


def tree_pack(packed: PackedBatch) -> TreePacking:
    """Pack ``packed`` (from :func:`trajflow.modeling.packing.pack`) as a prompt tree plus responses."""
    b = packed.input_ids.shape[0]
    row_prompts = _row_prompts(packed)
    index: dict[tuple, int] = {}
    inverse = [index.setdefault(p, len(index)) for p in row_prompts]
    distinct = list(index)
    k = len(distinct)
    c = common_prefix_length(distinct)
    resp_lens = packed.response_mask.sum(-1).tolist()
    resp_rows = packed.responses.tolist()
    ids: list[int] = list(distinct[0][:c])
    pos: list[int] = list(range(c))
    seg: list[int] = [0] * c  # segment 0: the prefix; 1..k: prompts' rests; k+1..k+b: responses
    last, starts, blocks = [0] * k, [0] * b, []
    for j, p in enumerate(distinct):
        begin = len(ids)
        ids.extend(p[c:])
        pos.extend(range(c, len(p)))
        seg.extend([1 + j] * (len(p) - c))
        last[j] = len(ids) - 1
        for i in (i for i in range(b) if inverse[i] == j):
            n_in = max(int(resp_lens[i]) - 1, 0)
            starts[i] = len(ids)
            ids.extend(resp_rows[i][:n_in])
            pos.extend(range(len(p), len(p) + n_in))
            seg.extend([1 + k + i] * n_in)
        blocks.append((begin, len(ids)))
    source: list[int] = []
    for i in range(b):  # row-major, the order of the response mask's real tokens
        if resp_lens[i] > 0:
            source.append(last[inverse[i]])
            source.extend(range(starts[i], starts[i] + int(resp_lens[i]) - 1))
    S = 1 + k + b
    sees = torch.eye(S, dtype=torch.bool)  # sees[s, t]: segment s may attend to segment t
    if c > 0:
        sees[:, 0] = True
    inv = torch.tensor(inverse, dtype=torch.long)
    sees[torch.arange(1 + k, S), 1 + inv] = True
    seg_t = torch.tensor(seg, dtype=torch.long)
    N = len(ids)
    mask = sees[seg_t][:, seg_t] & torch.ones(N, N, dtype=torch.bool).tril()
    device = packed.input_ids.device
    prefix = torch.arange(c)
    block_masks = tuple(mask[s:e][:, torch.cat([prefix, torch.arange(s, e)])][None, None].to(device)
                        for s, e in blocks)
    return TreePacking(torch.tensor([ids], dtype=torch.long, device=device),
                       torch.tensor([pos], dtype=torch.long, device=device),
                       mask[None, None].to(device), torch.tensor(source, dtype=torch.long, device=device),
                       c, tuple(blocks), block_masks)


#: Name under which :func:`tree_attention_forward` is registered with transformers' AttentionInterface.
TREE_ATTENTION = "trajflow_tree_sdpa"


def tree_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                           tree: TreePacking | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """Scaled dot-product attention (Vaswani et al. 2017, eq. 1) over a tree-packed sequence, block
    by block; a transformers attention function (its signature and output layout).

    Args:
        query: ``(1, H, N, D)``; key, value: ``(1, H_kv, N, D)`` (grouped-query attention: each key/value
            head serves ``H / H_kv`` query heads).
        attention_mask: the dense ``(1, 1, N, N)`` tree mask, used (through transformers' SDPA
            function) only without ``tree``.
        tree: the packing (:class:`TreePacking`): its prefix and blocks.

    Returns:
        ``(output, None)``, ``output`` ``(1, N, H, D)``.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if tree is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    sdpa = functools.partial(torch.nn.functional.scaled_dot_product_attention,
                             enable_gqa=query.shape[1] != key.shape[1])
    c = tree.common
    # The prefix and the blocks tile the sequence in order. One split per tensor (its backward is one
    # cat) rather than a slice per block (each slice's backward zero-fills a full-size gradient).
    sizes = ([c] if c else []) + [e - s for s, e in tree.blocks]
    qs, ks, vs = (torch.split(t, sizes, dim=2) for t in (query, key, value))
    outs = []
    if c:
        outs.append(sdpa(qs[0], ks[0], vs[0], dropout_p=dropout, scale=scaling, is_causal=True))
        qs, kp, vp, ks, vs = qs[1:], ks[0], vs[0], ks[1:], vs[1:]
    for q, k, v, m in zip(qs, ks, vs, tree.block_masks):
        if c:
            k, v = torch.cat([kp, k], dim=2), torch.cat([vp, v], dim=2)
        outs.append(sdpa(q, k, v, attn_mask=m, dropout_p=dropout, scale=scaling))
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous(), None


@contextlib.contextmanager
def _attention_implementation(model: torch.nn.Module, name: str) -> Iterator[None]:
    """Route the model's attention layers to the registered attention function ``name`` for one call.

    transformers picks the attention function by ``config._attn_implementation`` at every call, and
    passes the decoder call's extra keyword arguments (here ``tree``) down to it.
    """
    from transformers import AttentionInterface

    if name not in AttentionInterface._global_mapping:
        AttentionInterface.register(name, tree_attention_forward)
    config = model.config
    before = config._attn_implementation
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = before


def tree_hidden_states(model: torch.nn.Module, packed: PackedBatch) -> torch.Tensor:
    """Final hidden states that predict ``packed``'s real response tokens, from one decoder call
    over :func:`tree_pack`'s sequence: ``(R, hidden)``, model dtype, rows in the row-major order of
    ``packed.response_mask.nonzero()``.

    The attention layers run :func:`tree_attention_forward` during this call, except under
    activation checkpointing in training: the backward's recomputation runs outside this call and
    must save the same tensors as the forward did, so both use SDPA with the dense tree mask.
    """
    tree = tree_pack(packed)
    decoder = model.get_decoder()
    kwargs = dict(input_ids=tree.input_ids, attention_mask=tree.attention_mask, position_ids=tree.position_ids,
                  use_cache=False)
    if model.training and getattr(model, "is_activation_checkpointing", False):
        out = decoder(**kwargs)
    else:
        with _attention_implementation(model, TREE_ATTENTION):
            out = decoder(**kwargs, tree=tree)
    return out.last_hidden_state[0].index_select(0, tree.source)
