"""Teacher-forced forward passes over packed (prompt, response) micro-batches, shared by every
model worker: log-probs and entropy of the response tokens, computing each distinct prompt once.

:func:`response_hidden_states` picks tree packing (:mod:`trajflow.modeling.tree`) or cached prompts;
``docs/scaling.md`` ("Shared prompts") describes both and what they save.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from trajflow.modeling.compat import cache_kwargs, output_cache
from trajflow.modeling.packing import PackedBatch, micro_batch_plan, pack
from trajflow.modeling.precision import autocast, fp32_region
from trajflow.modeling.support import TREE_KERNELS, fast_path_unsupported, final_logits, note_fallback, sliding_window
from trajflow.modeling.token_logprobs import token_logprobs_entropy
from trajflow.modeling.tree import TREE_MAX_TOKENS, common_prefix_length, tree_hidden_states, tree_packed_tokens


def shared_prompt_rows(packed: PackedBatch) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Rows with identical (padded) prompts: ``(first_row, inverse)`` or ``None`` if all differ.

    Returns:
        ``first_row`` ``(k,)`` int64, one row index per distinct prompt, and ``inverse`` ``(b,)`` int64,
        the distinct prompt of each row (``first_row[inverse[i]]`` has row ``i``'s prompt).
    """
    P = packed.prompt_width
    # ids and mask together: a prompt that starts with the pad id is not the shorter prompt's padding.
    key = packed.input_ids[:, :P] * 2 + packed.attention_mask[:, :P]
    uniq, inverse = torch.unique(key, dim=0, return_inverse=True)
    if uniq.shape[0] == key.shape[0]:
        return None
    first = torch.full((uniq.shape[0],), key.shape[0], dtype=torch.long, device=key.device)
    first = first.scatter_reduce(0, inverse, torch.arange(key.shape[0], device=key.device), reduce="amin")
    return first, inverse


def zero3_partitioned(model: torch.nn.Module) -> bool:
    """Whether DeepSpeed ZeRO-3 partitions the model's parameters (they carry a ``ds_id``).

    Every rank must then run the same sequence of module forwards (each gathers parameters
    collectively), so the data-dependent shared-prompt path is not taken.
    """
    first = next(model.parameters(), None)
    return first is not None and hasattr(first, "ds_id")


def parameters_sharded(model: torch.nn.Module) -> bool:
    """Whether the model's parameters are sharded across data-parallel ranks: DeepSpeed ZeRO-3
    (:func:`zero3_partitioned`) or FSDP2 (``fully_shard`` makes them ``DTensor`` s).

    Each module forward then gathers parameters collectively, so every rank must run the same
    sequence of module forwards: the data-dependent shared-prompt paths are not taken.
    """
    from torch.distributed.fsdp import FSDPModule

    # FSDP2 swaps a unit's parameters for plain tensors while it is gathered, so the units
    # themselves (FSDPModule subclasses) are what is looked for, not the parameters' type.
    return zero3_partitioned(model) or any(isinstance(m, FSDPModule) for m in model.modules())


@dataclass
class PromptLayout:
    """Distinct prompts laid out around their common prefix, for a cached prompt forward.

    Row layout (``c`` = common prefix length, ``W`` = longest suffix)::

        [common prefix, c tokens | pad ... pad | this prompt's suffix]

    so the prefix is column-aligned (computed once, for one row) and every prompt's last token is in
    the last column. Padding in the middle is masked out and position ids count real tokens only,
    so each prompt sees exactly its own tokens at their usual positions.

    Attributes:
        input_ids: ``(k, c + W)`` int64.
        attention_mask: ``(k, c + W)`` int64.
        position_ids: ``(k, c + W)`` int64.
        common: ``c``; 0 when there is one prompt or no shared prefix.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    common: int


def layout_prompts(prompts: Sequence[Sequence[int]], pad_id: int,
                   device: str | torch.device = "cpu", share_prefix: bool = True) -> PromptLayout:
    """Lay out ``prompts`` (each non-empty) around their longest common prefix; see :class:`PromptLayout`.

    The prefix stops one token short of the shortest prompt, so every row keeps a suffix token.
    ``share_prefix=False`` left-pads every prompt whole (``common`` 0): what a model with a sliding
    window needs, as transformers' sliding-window masks count index distance and the padding after
    the prefix would put the window in the wrong place.
    """
    k = len(prompts)
    c = common_prefix_length(prompts) if share_prefix else 0
    W = max(len(p) - c for p in prompts)
    ids = np.full((k, c + W), pad_id, dtype=np.int64)
    attn = np.zeros((k, c + W), dtype=np.int64)
    for i, p in enumerate(prompts):
        ids[i, :c] = p[:c]
        ids[i, c + W - (len(p) - c):] = p[c:]
        attn[i, :c] = 1
        attn[i, c + W - (len(p) - c):] = 1
    attention_mask = torch.from_numpy(attn)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return PromptLayout(torch.from_numpy(ids).to(device), attention_mask.to(device), position_ids.to(device), c)


def encode_prompts(decoder: torch.nn.Module, layout: PromptLayout, width: int | None = None,
                   inputs_embeds: torch.Tensor | None = None):
    """Run the decoder over the first ``width`` columns of ``layout`` (all by default) with a KV cache.

    The common prefix runs once, for one row, and its cache is repeated to the ``k`` rows (a
    differentiable copy: the backward sums the rows' gradients) before the suffixes run against it.

    Args:
        inputs_embeds: optional ``(k, c + W, d)`` input embeddings of ``layout.input_ids`` (callers that
            embed several pieces in one call pass them; see :func:`response_hidden_states`).

    Returns:
        ``(hidden, cache)``: ``hidden`` ``(k, width - c, d)`` the suffix columns' last hidden states
        (``None`` if there are none), ``cache`` the transformers ``Cache`` of all ``width`` columns
        (``k`` rows).
    """
    width = layout.input_ids.shape[1] if width is None else width
    c, k = layout.common, layout.input_ids.shape[0]
    cache = None

    def tokens(rows: slice, cols: slice) -> dict:
        if inputs_embeds is not None:
            return {"inputs_embeds": inputs_embeds[rows, cols]}
        return {"input_ids": layout.input_ids[rows, cols]}

    if c > 0:
        cache = decoder(**tokens(slice(0, 1), slice(0, c)), attention_mask=layout.attention_mask[:1, :c],
                        position_ids=layout.position_ids[:1, :c], use_cache=True)
        cache = output_cache(cache)
        cache.batch_repeat_interleave(k)
    if width <= c:
        return None, cache
    out = decoder(**tokens(slice(None), slice(c, width)), attention_mask=layout.attention_mask[:, :width],
                  position_ids=layout.position_ids[:, c:width], **cache_kwargs(cache), use_cache=True)
    return out.last_hidden_state, output_cache(out)


# Cost of one more decoder call over a bucket of response rows, in padded token positions. A padded
# position costs a full token's forward and backward (~16 ms for SmolLM2 on 2 CPU cores); a call's
# fixed cost (30 layers of small kernels launched from Python) is a few of them.
BUCKET_OVERHEAD = 8


def length_buckets(lengths: Sequence[int], overhead: int = BUCKET_OVERHEAD) -> list[list[int]]:
    """Rows grouped by length so that padding each group to its longest costs least.

    Minimises ``sum over buckets (rows * longest) + overhead * buckets`` exactly, by dynamic
    programming over the rows sorted by length (an optimal grouping is contiguous in that order).

    Args:
        lengths: per-row lengths (>= 0).
        overhead: cost of one more bucket, in padded positions; 0 gives one bucket per distinct
            length, a large value one bucket.

    Returns:
        Row indices per bucket, buckets in increasing length, rows within a bucket by length then index.
    """
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    L = [int(lengths[i]) for i in order]
    n = len(L)
    best = [0.0] + [float("inf")] * n
    start = [0] * (n + 1)
    for j in range(1, n + 1):  # best grouping of the j shortest rows; its last bucket is rows i..j-1
        for i in range(j):
            cost = best[i] + (j - i) * L[j - 1] + overhead
            if cost < best[j]:
                best[j], start[j] = cost, i
    buckets, j = [], n
    while j > 0:
        buckets.append(order[start[j]:j])
        j = start[j]
    return buckets[::-1]


def prefix_fits_window(config, total_length: int) -> bool:
    """Whether prompts may share a column-aligned common prefix (:class:`PromptLayout`) in rows of up
    to ``total_length`` tokens: always without a sliding window, else only if no key can fall out
    of the window (transformers' sliding masks count columns, and the padding after the prefix
    adds columns)."""
    window = sliding_window(config)
    return window is None or total_length <= window


def uses_tree_packing(model: torch.nn.Module, packed: PackedBatch, share_prompts: bool = True,
                      tree_max_tokens: int = TREE_MAX_TOKENS) -> bool:
    """Whether :func:`response_hidden_states` runs ``packed`` as one tree-packed sequence.

    Needs prompt sharing, a parity-tested model (:func:`trajflow.modeling.support.fast_path_unsupported`),
    SDPA or eager attention (kernels the tree forward runs piece by piece), no sharded parameters
    (:func:`parameters_sharded`: ZeRO-3 or FSDP2) and at most ``tree_max_tokens`` packed tokens.
    """
    return (share_prompts and getattr(model.config, "_attn_implementation", None) in TREE_KERNELS
            and fast_path_unsupported(model) is None
            and not parameters_sharded(model) and tree_packed_tokens(packed) <= tree_max_tokens)


def response_hidden_states(model: torch.nn.Module, packed: PackedBatch, share_prompts: bool = True,
                           bucket_overhead: int = BUCKET_OVERHEAD,
                           tree_max_tokens: int = TREE_MAX_TOKENS) -> torch.Tensor:
    """Final hidden states that predict the real response tokens: ``(n, hidden)``, model dtype, one
    row per True entry of ``packed.response_mask`` in row-major order (padding is never kept).

    With ``share_prompts`` each distinct prompt token is computed once per micro-batch, in one of two
    ways (same values up to float rounding):

    - **tree packing** (:func:`uses_tree_packing`: SDPA and at most ``tree_max_tokens`` packed
      tokens): the prompts and responses form one sequence with a tree attention mask
      (:func:`tree_hidden_states`), one decoder call;
    - **cached prompts** otherwise (no gradient checkpointing, which turns the KV cache off, and no
      ZeRO-3 partitioning): the distinct prompts are encoded around their common prefix
      (:func:`encode_prompts`), the cache is copied to the rows that share each prompt, and the
      responses run against it in buckets of similar length (:func:`length_buckets`), each padded
      only to its own longest.

    Otherwise, or when there is nothing to share, one forward over the whole padded batch.
    """
    if uses_tree_packing(model, packed, share_prompts, tree_max_tokens):
        return tree_hidden_states(model, packed)
    h = _cached_prompt_hidden_states(model, packed, share_prompts, bucket_overhead)
    real = packed.response_mask.reshape(-1).nonzero().squeeze(1)
    return h.reshape(-1, h.shape[-1]).index_select(0, real)


def _cached_prompt_hidden_states(model: torch.nn.Module, packed: PackedBatch, share_prompts: bool,
                                 bucket_overhead: int) -> torch.Tensor:
    """:func:`response_hidden_states` without tree packing, as ``(b, T, hidden)`` (0 at padded
    response positions): cached prompts and response buckets, or one padded forward when nothing
    can be shared."""
    decoder = model.get_decoder()
    P = packed.prompt_width
    T = packed.responses.shape[1]
    can_share = share_prompts and not (model.training and getattr(model, "is_activation_checkpointing", False)) \
        and not parameters_sharded(model)
    layout = None
    if can_share:
        shared = shared_prompt_rows(packed)
        b = packed.input_ids.shape[0]
        first, inverse = shared if shared is not None else (torch.arange(b), torch.arange(b))
        lens = packed.attention_mask[first, :P].sum(-1).tolist()
        prompts = [packed.input_ids[f, P - n:P].tolist() for f, n in zip(first.tolist(), lens)]
        layout = layout_prompts(prompts, 0, packed.input_ids.device,
                                share_prefix=prefix_fits_window(model.config, packed.input_ids.shape[1]))
        if shared is None and layout.common == 0:
            layout = None  # nothing to share
    if layout is None:
        hidden = decoder(input_ids=packed.input_ids, attention_mask=packed.attention_mask,
                         position_ids=packed.position_ids, use_cache=False).last_hidden_state
        return hidden[:, P - 1:P - 1 + T]
    # One embedding call for all decoder calls: on CPU each embedding backward zero-fills and adds a
    # dense vocab x hidden gradient (113 MB for SmolLM2), which several calls would do as often.
    k, width = layout.input_ids.shape
    b = packed.input_ids.shape[0]
    ids = torch.cat([layout.input_ids.reshape(-1), packed.input_ids[:, P:P + T - 1].reshape(-1)])
    embeds = model.get_input_embeddings()(ids)
    d = embeds.shape[-1]
    prompt_embeds = embeds[:k * width].reshape(k, width, d)
    resp_embeds = embeds[k * width:].reshape(b, T - 1, d)
    prompt_hidden, cache = encode_prompts(decoder, layout, inputs_embeds=prompt_embeds)
    h_first = prompt_hidden[inverse, -1:]  # the prompt's last token predicts response token 0
    if T == 1:
        return h_first
    # Response token t (t >= 1) is predicted from the inputs up to token t - 1: a row of length l
    # needs l - 1 input columns.
    widths = (packed.response_mask.sum(-1) - 1).clamp(min=0).tolist()
    buckets = [rows for rows in length_buckets(widths, bucket_overhead) if max(widths[r] for r in rows) > 0]
    prompt_mask = layout.attention_mask[inverse]
    whole = len(buckets) == 1 and len(buckets[0]) == b  # one bucket of every row: no cache copy
    parts, order = [], []
    for rows in buckets:
        w = max(widths[r] for r in rows)
        if whole:
            rows, sub, bucket_cache = list(range(b)), slice(None), cache
        else:
            sub = torch.tensor(rows, device=inverse.device)
            # A copy per bucket (the base cache is shared by all of them), gathered differentiably:
            # the prompt forward's backward receives every bucket's share.
            bucket_cache = copy.copy(cache)
            bucket_cache.layers = [copy.copy(layer) for layer in cache.layers]
        bucket_cache.batch_select_indices(inverse[sub])
        mask = torch.cat([prompt_mask[sub], packed.attention_mask[sub, P:P + w]], dim=1)
        out = decoder(inputs_embeds=resp_embeds[sub, :w], attention_mask=mask,
                      position_ids=packed.position_ids[sub, P:P + w], **cache_kwargs(bucket_cache),
                      use_cache=True)
        parts.append(torch.nn.functional.pad(out.last_hidden_state, (0, 0, 0, T - 1 - w)))
        order.extend(rows)
    done = set(order)
    rest = [r for r in range(b) if r not in done]  # one-token responses: nothing after token 0
    if rest:
        parts.append(h_first.new_zeros(len(rest), T - 1, d))
        order.extend(rest)
    resp_hidden = torch.cat(parts)
    if order != list(range(b)):  # back to row order: row r sits at position argsort(order)[r]
        resp_hidden = resp_hidden.index_select(0, torch.tensor(order, device=resp_hidden.device).argsort())
    return torch.cat([h_first, resp_hidden], dim=1)


def forward_micro_batch(model: torch.nn.Module, packed: PackedBatch, temperature: float,
                        compute_entropy: bool = False, logits_chunk: int = 1024,
                        share_prompts: bool = True, entropy_grad: bool = False,
                        bucket_overhead: int = BUCKET_OVERHEAD,
                        tree_max_tokens: int = TREE_MAX_TOKENS) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and optionally entropy) of the response tokens under ``model``.

    Args:
        model: a transformers causal LM (``get_decoder()`` and ``get_output_embeddings()``).
        packed: from :func:`pack`.
        temperature: sampling temperature of the rollout (> 0).
        compute_entropy: also return the per-token entropy of ``softmax(logits / temperature)``.
        logits_chunk: response positions sent through the LM head at a time.
        share_prompts: run each distinct prompt once (see :func:`response_hidden_states`); same values up to rounding.
        bucket_overhead: see :func:`length_buckets`.
        tree_max_tokens: longest micro-batch run as one tree-packed sequence (:func:`uses_tree_packing`).
        entropy_grad: make the entropy differentiable (only an entropy bonus needs it). Without
            it the entropy is a metric with no gradient, and the backward keeps only the softmax
            of each chunk (:class:`trajflow.modeling.token_logprobs.LogProbEntropy`).

    Returns:
        ``log_probs`` ``(b, T)`` float32 and ``entropy`` ``(b, T)`` float32 or ``None``; 0 at positions
        outside ``packed.response_mask`` (padding is never sent through the LM head).

    A model the fast paths are not verified for (:func:`trajflow.modeling.support.fast_path_unsupported`)
    runs through its own full forward instead (:func:`plain_response_logits`).
    """
    head = model.get_output_embeddings()
    b, T = packed.responses.shape
    # The LM head (576 x 49k for SmolLM2, a fifth of a token's FLOPs) runs on real response tokens
    # only: right padding up to the micro-batch's longest response never reaches it.
    real = packed.response_mask.reshape(-1).nonzero().squeeze(1)
    flat_y = packed.responses.reshape(b * T).index_select(0, real)
    reason = fast_path_unsupported(model)
    if reason is not None:
        note_fallback(model, "the teacher-forced forward", reason)
        flat_h = plain_response_logits(model, packed).reshape(b * T, -1).index_select(0, real)

        def to_logits(z: torch.Tensor) -> torch.Tensor:
            return z
    else:
        flat_h = response_hidden_states(model, packed, share_prompts, bucket_overhead, tree_max_tokens)

        def to_logits(h: torch.Tensor) -> torch.Tensor:
            return final_logits(model.config, head(h))
    logps, ents = [], []
    for i in range(0, flat_h.shape[0], logits_chunk):
        logits = to_logits(flat_h[i:i + logits_chunk])
        # Under a bf16 autocast the head's logits are bf16; the log-softmax over 49k-152k columns
        # and the entropy are computed from their float32 cast, outside autocast.
        with fp32_region(flat_h.device):
            logp, ent = token_logprobs_entropy(logits, flat_y[i:i + logits_chunk], temperature, entropy_grad,
                                               compute_entropy)
        logps.append(logp)
        if compute_entropy:
            ents.append(ent)

    def unflatten(parts: list[torch.Tensor]) -> torch.Tensor:
        vals = torch.cat(parts) if parts else flat_h.new_zeros(0, dtype=torch.float32)
        return vals.new_zeros(b * T).index_copy(0, real, vals).reshape(b, T)

    return unflatten(logps), (unflatten(ents) if compute_entropy else None)


def plain_response_logits(model: torch.nn.Module, packed: PackedBatch) -> torch.Tensor:
    """Logits that predict every response column from the model's own full forward over the padded
    batch (whatever its causal-LM head applies, applied): ``(b, T, V)``, model dtype.

    Only the last ``T + 1`` positions go through the head where the model takes ``logits_to_keep``.
    """
    import inspect

    T = packed.responses.shape[1]
    params = inspect.signature(model.forward).parameters
    kwargs = dict(input_ids=packed.input_ids, attention_mask=packed.attention_mask, use_cache=False)
    if "position_ids" in params:
        kwargs["position_ids"] = packed.position_ids
    if "logits_to_keep" in params:
        kwargs["logits_to_keep"] = T + 1
    logits = model(**kwargs).logits
    return logits[:, -(T + 1):-1]


@torch.no_grad()
def compute_log_probs(model: torch.nn.Module, prompt_ids: Sequence[Sequence[int]],
                      response_ids: Sequence[Sequence[int]], *, temperature: float, micro_batch_size: int,
                      pad_id: int, device: str = "cpu", compute_entropy: bool = False,
                      max_tokens: int | None = None, param_dtype: str = "float32",
                      forwards: Callable[[int], int] | None = None) -> tuple[list[np.ndarray], list[np.ndarray] | None]:
    """Per-token log-probs of every response, as ragged float32 arrays (one per row).

    Micro-batches follow :func:`micro_batch_plan` (``micro_batch_size`` rows, or a token budget of
    ``max_tokens``), the same packing the PPO update uses. ``param_dtype`` is the compute dtype of
    the forward (:func:`trajflow.modeling.precision.autocast`); log-probs are float32 either way.
    ``forwards`` maps this process's number of micro-batches to the number of forwards to run
    (sharded ranks: the largest over the ranks, :meth:`DataParallel.max_over_ranks`); the extra
    forwards repeat the first row and are discarded.
    """
    was_training = model.training
    model.eval()
    out: list[np.ndarray] = []
    ent_out: list[np.ndarray] | None = [] if compute_entropy else None
    plan = micro_batch_plan(prompt_ids, response_ids, micro_batch_size, max_tokens)
    total = forwards(len(plan)) if forwards is not None else len(plan)
    try:
        for i in range(total):
            live = i < len(plan)
            sl = plan[i] if live else slice(0, 1)
            if not live and not len(prompt_ids):
                raise ValueError("compute_log_probs: a rank without rows cannot join the other ranks' forwards")
            packed = pack(prompt_ids[sl], response_ids[sl], pad_id, device)
            with autocast(param_dtype, device):
                logp, ent = forward_micro_batch(model, packed, temperature, compute_entropy)
            if not live:
                continue
            for j, r in enumerate(response_ids[sl]):
                out.append(logp[j, :len(r)].float().cpu().numpy())
                if ent_out is not None:
                    ent_out.append(ent[j, :len(r)].float().cpu().numpy())
    finally:
        model.train(was_training)
    return out, ent_out
