"""Tree packing: a micro-batch's prompts and responses as one sequence, one decoder call::

    [common prefix | prompt 1's rest, its rows' responses | ... | prompt k's rest, its rows' responses]

with per-path position ids and a tree attention mask, so each distinct prompt token is computed once
and every linear layer runs one matmul over the micro-batch's tokens. Attention runs block by block
(:func:`tree_attention_forward`); ``docs/scaling.md`` ("Model compute") explains why.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import sys
from dataclasses import dataclass, field
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
        base_attention: the model's own attention implementation (``"sdpa"`` or ``"eager"``) that
            the tree forward runs piece by piece; set by :func:`tree_hidden_states`.
        eager_float: hand layers float additive masks (eager kernels add masks to the scores).

    A layer whose attention type restricts what a key may see (a sliding window) gets its own dense
    mask, :meth:`layer_mask`: ancestry as above, and the model's own mask function evaluated on the
    *positions* of query and key along the row's path (a row alone sits at index = position).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor
    source: torch.Tensor
    common: int = 0
    blocks: tuple = ()
    block_masks: tuple = ()
    base_attention: str = "sdpa"
    eager_float: bool = False
    _pieces: dict = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])

    def layer_mask(self, mask_function) -> torch.Tensor:
        """The dense ``(1, 1, N, N)`` bool mask of a layer whose transformers mask function (causal,
        sliding-window causal, ...; index-based, ``(batch, head, q_idx, kv_idx) -> bool``) is
        ``mask_function``: :attr:`attention_mask` itself where that function hides no ancestor (so
        full-attention layers keep the exact tensors and kernels they had), else the ancestors it
        allows at the query's and key's positions."""
        pos = self.position_ids[0]
        zero = torch.zeros((), dtype=torch.long, device=pos.device)
        allowed = mask_function(zero, zero, pos[:, None], pos[None, :]).to(torch.bool)
        mask = self.attention_mask & allowed[None, None]
        if torch.equal(mask, self.attention_mask):
            return self.attention_mask
        return mask

    def pieces(self, mask: torch.Tensor) -> tuple[torch.Tensor | None, tuple]:
        """``mask`` (a :meth:`layer_mask`) cut like :attr:`block_masks`: ``(prefix_mask, block_masks)``,
        ``prefix_mask`` ``(1, 1, c, c)`` bool (``None`` without a prefix). Memoised per mask: every
        layer of one attention type shares it."""
        if mask is self.attention_mask:
            c = self.common
            return (self.attention_mask[:, :, :c, :c] if c else None), self.block_masks
        key = id(mask)
        if key not in self._pieces:
            c, m = self.common, mask[0, 0]
            prefix = torch.arange(c, device=m.device)
            blocks = tuple(m[s:e][:, torch.cat([prefix, torch.arange(s, e, device=m.device)])][None, None]
                           for s, e in self.blocks)
            self._pieces[key] = (mask, (m[:c, :c][None, None] if c else None), blocks)
        _, prefix_mask, blocks = self._pieces[key]
        return prefix_mask, blocks


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


#: Name under which :func:`tree_attention_forward` and :func:`tree_layer_mask` are registered with
#: transformers' AttentionInterface and AttentionMaskInterface.
TREE_ATTENTION = "trajflow_tree_sdpa"
#: The dense variant (activation checkpointing): the model's own attention kernel, tree masks.
TREE_DENSE_ATTENTION = "trajflow_tree_dense"

# The packing of the decoder call in flight: transformers' mask builders only see sizes and a mask
# function, so the tree reaches the mask interface through here.
_CURRENT_TREE: contextvars.ContextVar[TreePacking | None] = contextvars.ContextVar("trajflow_tree", default=None)


def tree_layer_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                    mask_function=None, attention_mask=None, dtype: torch.dtype = torch.float32, **kwargs):
    """transformers mask interface (``masking_utils.ALL_MASK_ATTENTION_FUNCTIONS``) of the tree forward.

    The model's own code decides which mask each layer gets (``create_causal_mask`` for full
    attention, ``create_sliding_window_causal_mask`` for a sliding window; one for every layer or a
    dict keyed by ``config.layer_types``); each builder calls this with its index-based mask
    function, which :meth:`TreePacking.layer_mask` evaluates on path positions.

    Returns:
        ``(1, 1, N, N)``: bool (True = visible), or float (0 / dtype min) for an eager kernel.
    """
    tree = _CURRENT_TREE.get()
    if tree is None or q_length != tree.num_tokens or kv_length != tree.num_tokens or q_offset or kv_offset:
        raise RuntimeError("the tree attention mask was built outside trajflow's tree-packed forward")
    mask = tree.layer_mask(mask_function)
    if tree.eager_float:
        mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)
    return mask


def _eager_kernel(module: torch.nn.Module):
    """The model's own eager attention function, defined next to its attention class (some, such as
    Gemma 2's, soft-cap the scores)."""
    fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if fn is None:
        raise RuntimeError(f"{type(module).__name__}: no eager_attention_forward next to it for the tree forward")
    return fn


def _base_kernel(module: torch.nn.Module, name: str):
    if name == "eager":
        return _eager_kernel(module)
    from transformers import AttentionInterface

    return AttentionInterface._global_mapping[name]


def tree_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                           tree: TreePacking | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """Scaled dot-product attention (Vaswani et al. 2017, eq. 1) over a tree-packed sequence, block
    by block; a transformers attention function (its signature and output layout).

    Args:
        query: ``(1, H, N, D)``; key, value: ``(1, H_kv, N, D)`` (grouped-query attention: each key/value
            head serves ``H / H_kv`` query heads).
        attention_mask: this layer's dense ``(1, 1, N, N)`` bool tree mask (:func:`tree_layer_mask`;
            a sliding-window layer's differs from a full-attention layer's).
        scaling: the layer's query scaling (e.g. Gemma's ``query_pre_attn_scalar ** -0.5``).
        tree: the packing (:class:`TreePacking`): its prefix and blocks.
        kwargs: the layer's other attention arguments (``softcap``, ``sliding_window``, ...), passed
            unchanged to the model's own kernel when that is not SDPA.

    Returns:
        ``(output, None)``, ``output`` ``(1, N, H, D)``.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if tree is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    c = tree.common
    # The prefix and the blocks tile the sequence in order. One split per tensor (its backward is one
    # cat) rather than a slice per block (each slice's backward zero-fills a full-size gradient).
    sizes = ([c] if c else []) + [e - s for s, e in tree.blocks]
    qs, ks, vs = (torch.split(t, sizes, dim=2) for t in (query, key, value))
    prefix_mask, block_masks = tree.pieces(attention_mask)
    if tree.base_attention != "sdpa":
        return _tree_attention_kernel(module, _eager_kernel(module), qs, ks, vs, c, prefix_mask, block_masks,
                                      dropout, scaling, kwargs)
    sdpa = functools.partial(torch.nn.functional.scaled_dot_product_attention,
                             enable_gqa=query.shape[1] != key.shape[1])
    outs = []
    if c:
        if attention_mask is tree.attention_mask:
            outs.append(sdpa(qs[0], ks[0], vs[0], dropout_p=dropout, scale=scaling, is_causal=True))
        else:  # a window shorter than the prefix
            outs.append(sdpa(qs[0], ks[0], vs[0], attn_mask=prefix_mask, dropout_p=dropout, scale=scaling))
        qs, kp, vp, ks, vs = qs[1:], ks[0], vs[0], ks[1:], vs[1:]
    for q, k, v, m in zip(qs, ks, vs, block_masks):
        if c:
            k, v = torch.cat([kp, k], dim=2), torch.cat([vp, v], dim=2)
        outs.append(sdpa(q, k, v, attn_mask=m, dropout_p=dropout, scale=scaling))
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous(), None


def _tree_attention_kernel(module, kernel, qs, ks, vs, c, prefix_mask, block_masks, dropout, scaling,
                           kwargs) -> tuple[torch.Tensor, None]:
    """:func:`tree_attention_forward` with the model's own (non-SDPA) kernel per piece, each given a
    float additive mask as transformers' eager masks are: whatever the kernel applies (soft-capping,
    its scaling) applies here too. Returns ``((1, N, H, D), None)``."""
    def run(q, k, v, m):
        add = torch.zeros(m.shape, dtype=q.dtype, device=q.device).masked_fill(~m, torch.finfo(q.dtype).min)
        return kernel(module, q, k, v, add, dropout=dropout, scaling=scaling, **kwargs)[0]

    outs = []
    if c:
        outs.append(run(qs[0], ks[0], vs[0], prefix_mask))
        qs, kp, vp, ks, vs = qs[1:], ks[0], vs[0], ks[1:], vs[1:]
    for q, k, v, m in zip(qs, ks, vs, block_masks):
        if c:
            k, v = torch.cat([kp, k], dim=2), torch.cat([vp, v], dim=2)
        outs.append(run(q, k, v, m))
    return torch.cat(outs, dim=1).contiguous(), None


def _dense_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, tree: TreePacking | None = None, **kwargs):
    """The model's own attention kernel over the whole packed sequence with this layer's dense tree
    mask: the kernel the recomputation under activation checkpointing finds (the config is restored
    by then), so that forward and recomputation save the same tensors."""
    name = tree.base_attention if tree is not None else "sdpa"
    return _base_kernel(module, name)(module, query, key, value, attention_mask, **kwargs)


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    for name, fn in ((TREE_ATTENTION, tree_attention_forward), (TREE_DENSE_ATTENTION, _dense_attention_forward)):
        if name not in AttentionInterface._global_mapping:
            AttentionInterface.register(name, fn)
        if name not in AttentionMaskInterface._global_mapping:
            AttentionMaskInterface.register(name, tree_layer_mask)


@contextlib.contextmanager
def _attention_implementation(model: torch.nn.Module, name: str) -> Iterator[None]:
    """Route the model's attention layers (and its mask builders) to the registered ``name`` for one call.

    transformers picks the attention function and the mask interface by ``config._attn_implementation``
    at every call, and passes the decoder call's extra keyword arguments (here ``tree``) down to the
    attention function.
    """
    _register()
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

    The model's own code builds each layer's mask (full, sliding window, per ``layer_types``) through
    :func:`tree_layer_mask`. The attention layers run :func:`tree_attention_forward` during this call,
    except under activation checkpointing in training: the backward's recomputation runs outside this
    call and must save the same tensors as the forward did, so both use the model's own kernel with
    the dense tree masks.
    """
    tree = tree_pack(packed)
    tree.base_attention = model.config._attn_implementation
    decoder = model.get_decoder()
    # A 2D all-ones mask (not the 4D tree mask, which transformers would hand every layer unchanged)
    # makes the model build one mask per attention type, through tree_layer_mask.
    kwargs = dict(input_ids=tree.input_ids, attention_mask=torch.ones_like(tree.input_ids),
                  position_ids=tree.position_ids, use_cache=False, tree=tree)
    dense = model.training and getattr(model, "is_activation_checkpointing", False)
    tree.eager_float = dense and tree.base_attention == "eager"
    token = _CURRENT_TREE.set(tree)
    try:
        with _attention_implementation(model, TREE_DENSE_ATTENTION if dense else TREE_ATTENTION):
            out = decoder(**kwargs)
    finally:
        _CURRENT_TREE.reset(token)
    return out.last_hidden_state[0].index_select(0, tree.source)
