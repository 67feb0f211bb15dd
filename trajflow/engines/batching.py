"""Continuous batching for the Hugging Face engine's decode loop.

A decode step costs about the same whether it runs 8 rows or 32 (on a CPU it is bound by reading the
weights and by small-M matmuls), so the loop keeps its decode slots full: when rows end, the next
prompts are prefilled and their KV caches joined to the running batch, instead of the whole batch
draining to its longest response before the next prompts start (what vLLM and SGLang's schedulers
do with paged KV blocks; here the dense ``DynamicCache`` is padded on the left and concatenated).

Samples do not depend on the schedule: every output row reads its own pre-drawn uniform for each of
its tokens, from the stream of the fixed group of prompts it belongs to, so the same seed gives the
same tokens whether a row started at the first decode step or joined later (up to float rounding
of a batch's matmuls, which also differs between batch sizes without any joining).
"""

from __future__ import annotations

import copy
from collections import deque
from typing import Callable, NamedTuple, Sequence

import torch

from trajflow.stages.rollout import SamplingParams, sample_tokens
from trajflow.engines.decode_step import decode_step, supports_decode_step
from trajflow.engines.kv_cache import use_slack_layers
from trajflow.modeling.compat import cache_kwargs, output_cache
from trajflow.modeling.forward import layout_prompts, encode_prompts
from trajflow.modeling.support import final_logits


def mergeable(cache) -> bool:
    """Whether ``cache`` is a transformers cache whose every layer is a plain ``DynamicLayer``
    (keys and values ``(rows, heads, seq, head_dim)`` holding every position). Sliding-window,
    quantized, static or recurrent layers keep something else and cannot be joined by padding."""
    from transformers.cache_utils import DynamicLayer

    from trajflow.engines.kv_cache import SlackLayer

    layers = getattr(cache, "layers", None)
    return bool(layers) and all(type(layer) in (DynamicLayer, SlackLayer) and getattr(layer, "keys", None) is not None
                                and layer.keys.dim() == 4 for layer in layers)


def join_caches(a, b, width_a: int, width_b: int) -> None:
    """Append ``b``'s rows to ``a`` in place, left-padding the shorter one's positions with zeros
    so both end at the same column (the attention mask marks the padding; its keys are never attended).

    Args:
        a, b: mergeable caches (:func:`mergeable`), ``width_a`` and ``width_b`` positions long.
    """
    width = max(width_a, width_b)
    for la, lb in zip(a.layers, b.layers):
        la.keys = torch.cat([_left_pad(la.keys, width - width_a), _left_pad(lb.keys, width - width_b)], dim=0)
        la.values = torch.cat([_left_pad(la.values, width - width_a), _left_pad(lb.values, width - width_b)], dim=0)


def drop_leading_positions(cache, k: int) -> None:
    """Remove the first ``k`` positions of every layer of a mergeable cache (columns that are padding
    for every row still in the batch)."""
    for layer in cache.layers:
        layer.keys = layer.keys[:, :, k:]
        layer.values = layer.values[:, :, k:]


def _left_pad(t: torch.Tensor, k: int) -> torch.Tensor:
    if k == 0:
        return t
    return torch.cat([t.new_zeros(t.shape[0], t.shape[1], k, t.shape[3]), t], dim=2)


def _left_pad_mask(m: torch.Tensor, width: int) -> torch.Tensor:
    k = width - m.shape[1]
    return m if k == 0 else torch.cat([m.new_zeros(m.shape[0], k), m], dim=1)


@torch.no_grad()
def decode_continuous(model: torch.nn.Module, prompts: Sequence[Sequence[int]], groups: Sequence[Sequence[int]],
                      seeds: Sequence[int], params: SamplingParams, slots: int, pad_id: int,
                      eos_ids: Sequence[int], device, share_prefix: bool, join: bool = True,
                      on_step: Callable[[int], None] | None = None,
                      in_place_cache: bool = True, split_groups: bool = True,
                      lean_step: bool = True, reuse_slots: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Sample ``params.n`` responses for every prompt with at most ``slots`` rows per decode step.

    Rows are admitted in the order of ``groups`` (lists of prompt indices, concatenated; a prompt's
    ``n`` rows one after the other), as many as there are free slots (``split_groups``; else whole
    prompts, one into an empty batch even if ``n > slots``). A prompt is prefilled once, when its first
    row is admitted, together with the next pending prompts (up to ``slots // n`` in all), laid out around
    their common prefix (:func:`layout_prompts`, :func:`encode_prompts`); its cache is kept until its
    last row is admitted, and each admitted row's copy is joined to the running batch
    (:func:`join_caches`). Each step feeds one token per live row at position = its count of real
    tokens; a row leaves at EOS or at ``params.max_new_tokens`` tokens, and columns that became padding
    for every remaining row are dropped. With ``join=False`` (or a cache that is not
    :func:`mergeable`) prompts are only admitted into an empty batch: each group then decodes alone
    until its last row ends, the loop without continuous batching.

    Sampling (:func:`trajflow.stages.rollout.sample_tokens`): group ``g``'s rows draw ``torch.rand(T, rows)``
    (float64) from a generator seeded with ``seeds[g]``, and row ``r``'s ``t``-th token reads entry
    ``[t, r]``, the same values a per-group loop drawing one ``(rows,)`` vector per step reads.

    Args:
        model: a transformers causal LM in eval mode (``get_decoder()``, ``get_output_embeddings()``).
        prompts: token ids, each non-empty.
        groups: a partition of ``range(len(prompts))``: the admission order and the RNG streams.
        seeds: one seed per group.
        slots: most rows per decode step (``rollout.micro_batch_size``).
        on_step: called with the number of rows of every decode forward (statistics).
        in_place_cache: append each step's keys and values in place
            (:class:`trajflow.engines.kv_cache.SlackLayer`) instead of ``torch.cat`` per step.
        split_groups: with continuous batching, fill every free slot at once with the next pending
            row, even if the rest of its prompt's ``n`` rows must wait for later slots (the prompt's
            prefilled KV cache is kept for them); off, a prompt starts only when ``n`` slots are free.
        lean_step: run each decode forward through :func:`trajflow.engines.decode_step.decode_step`
            where the model supports it (:func:`~trajflow.engines.decode_step.supports_decode_step`),
            instead of the model's own forward (same layers, less per-call machinery).
        reuse_slots: with ``split_groups``, rows that end while at least as many rows are pending
            stay in the batch for one more forward (its result unused) and the next admitted rows
            are written into their places in the KV cache (each layer's rows, right-aligned, the
            columns before the new prompt masked): no copy of the whole cache to drop rows and
            another to join new ones. Otherwise (or when a new prompt is wider than the batch) the
            ended rows are dropped as before.

    Returns:
        ``tokens`` ``(len(prompts) * n, T)`` int64, row ``i * n + s`` the ``s``-th sample of prompt
        ``i``, right-padded with ``pad_id`` after its EOS, and ``logprobs`` of the same shape, float32,
        under ``softmax(logits / temperature)`` (``None`` for greedy decoding: argmax, ties to the lowest id).
    """
    decoder, head = model.get_decoder(), model.get_output_embeddings()
    n, T = int(params.n), int(params.max_new_tokens)
    total = len(prompts) * n
    tokens = torch.full((total, T), pad_id, dtype=torch.long)
    logprobs = None if params.greedy else torch.zeros(total, T, dtype=torch.float32)
    group_of = {i: g for g, members in enumerate(groups) for i in members}
    column = {i: c for members in groups for c, i in enumerate(members)}  # a prompt's place in its group
    draws: dict[int, torch.Tensor] = {}     # group -> (T, rows) uniforms, until its last row is admitted
    unadmitted = {g: len(members) * n for g, members in enumerate(groups)}
    pending = deque((i, s) for members in groups for i in members for s in range(n))  # rows, prompt-major
    prefills = _Prefills(decoder, head, model.config, prompts, n, pad_id, device, share_prefix, max(1, slots // n))
    eos = torch.tensor(list(eos_ids), dtype=torch.long, device=device)
    lean = lean_step and supports_decode_step(model) is None

    rows = torch.zeros(0, dtype=torch.long)                 # output row of each batch row
    step = torch.zeros(0, dtype=torch.long)                 # tokens each batch row has written
    u_rows = None if params.greedy else torch.zeros(0, T, dtype=torch.float64)  # each batch row's draws
    logits = attn = pos = cache = None
    can_join = join
    # Batch rows that ended and are kept for one forward so that the next admission writes its rows
    # into their places: no copy of the whole cache (select, then join) when rows come and go.
    holes = torch.zeros(0, dtype=torch.long)
    while pending or rows.numel():
        live = rows.numel() - holes.numel()
        take: list[tuple[int, int]] = []
        if live == 0 or can_join:
            if can_join and split_groups:
                while pending and live + len(take) < slots:
                    take.append(pending.popleft())
            else:  # whole prompts (what is left of each), at least one into an empty batch
                while pending:
                    k = _leading_rows_of_one_prompt(pending)
                    if (live or take) and live + len(take) + k > slots:
                        break
                    take.extend(pending.popleft() for _ in range(k))
        pieces = prefills.admit(take, pending)
        if holes.numel() and (len(take) < holes.numel() or any(p.attn.shape[1] > attn.shape[1] for p in pieces)):
            rows, step, u_rows, logits, attn, pos = _close_holes(holes, cache, rows, step, u_rows, logits, attn, pos)
            holes = holes[:0]
        for piece in pieces:
            new_cache, new_logits, new_attn, new_pos = piece.cache, piece.logits, piece.attn, piece.pos
            if in_place_cache:
                use_slack_layers(new_cache, T)
            new_rows = torch.tensor([i * n + s for i, s in piece.rows], dtype=torch.long)
            new_u = None
            if not params.greedy:
                new_u = torch.stack([_group_draws(draws, group_of[i], groups, seeds, n, T)[:, column[i] * n + s]
                                     for i, s in piece.rows])
            for i, _ in piece.rows:
                g = group_of[i]
                unadmitted[g] -= 1
                if unadmitted[g] == 0:
                    draws.pop(g, None)
            k = min(holes.numel(), len(new_rows))
            if k:
                h, holes = holes[:k], holes[k:]
                _fill_rows(cache, new_cache, h, k, attn.shape[1])
                attn[h] = _left_pad_mask(new_attn[:k], attn.shape[1])
                logits[h], pos[h], rows[h], step[h] = new_logits[:k], new_pos[:k], new_rows[:k], 0
                if not params.greedy:
                    u_rows[h] = new_u[:k]
                if k == len(new_rows):
                    continue
                new_logits, new_attn, new_pos, new_rows = new_logits[k:], new_attn[k:], new_pos[k:], new_rows[k:]
                new_u = None if params.greedy else new_u[k:]
                for layer in new_cache.layers:
                    layer.keys, layer.values = layer.keys[k:], layer.values[k:]
            if rows.numel() == 0:
                cache, logits, attn, pos, rows, u_rows = new_cache, new_logits, new_attn, new_pos, new_rows, new_u
                step = torch.zeros(len(new_rows), dtype=torch.long)
                can_join = join and mergeable(cache)
            else:
                width = max(attn.shape[1], new_attn.shape[1])
                join_caches(cache, new_cache, attn.shape[1], new_attn.shape[1])
                attn = torch.cat([_left_pad_mask(attn, width), _left_pad_mask(new_attn, width)])
                logits, pos = torch.cat([logits, new_logits]), torch.cat([pos, new_pos])
                rows = torch.cat([rows, new_rows])
                u_rows = None if params.greedy else torch.cat([u_rows, new_u])
                step = torch.cat([step, torch.zeros(len(new_rows), dtype=torch.long)])

        if params.greedy:
            tok = logits.argmax(dim=-1)
        else:
            u = u_rows[torch.arange(len(rows)), step]
            tok, lp = sample_tokens(logits, params.temperature, u, params.top_p, params.top_k)
            logprobs[rows, step] = lp.cpu()
        tokens[rows, step] = tok.cpu()

        going = (~torch.isin(tok, eos)).cpu() & (step < T - 1)
        ended = (~going).nonzero().squeeze(1)
        if reuse_slots and can_join and split_groups and 0 < ended.numel() <= len(pending) \
                and ended.numel() < going.numel():
            holes = ended  # the next admission fills them (at least as many rows are pending)
        elif ended.numel():
            keep = going.nonzero().squeeze(1)
            rows, step = rows[keep], step[keep]
            u_rows = None if params.greedy else u_rows[keep]
            if rows.numel() == 0:
                cache = logits = attn = pos = None
                continue
            keep = keep.to(tok.device)
            tok, attn, pos = tok[keep], attn[keep], pos[keep]
            cache.batch_select_indices(keep)
            if can_join:
                # Columns that were padding for every row still here (left padding of rows that
                # joined a longer batch, or the prefix of rows that left): no query needs them.
                first = int(attn.any(dim=0).nonzero()[0])
                if first > 0:
                    attn = attn[:, first:]
                    drop_leading_positions(cache, first)
        attn = torch.cat([attn, attn.new_ones(attn.shape[0], 1)], dim=1)
        pos, step = pos + 1, step + 1
        if on_step is not None:
            on_step(int(rows.numel() - holes.numel()))
        if lean:
            hidden = decode_step(decoder, tok[:, None], attn, pos, cache)
        else:
            out = decoder(input_ids=tok[:, None], attention_mask=attn, position_ids=pos, **cache_kwargs(cache),
                          use_cache=True)
            cache, hidden = output_cache(out), out.last_hidden_state[:, -1]
        logits = final_logits(model.config, head(hidden))
    return tokens, logprobs


def _fill_rows(cache, new_cache, h: torch.Tensor, k: int, width: int) -> None:
    """Write the first ``k`` rows of ``new_cache`` into rows ``h`` of ``cache`` (``width`` positions),
    right-aligned; the columns before them keep stale values that the attention mask excludes."""
    for la, lb in zip(cache.layers, new_cache.layers):
        w = lb.keys.shape[2]
        la.keys[h, :, width - w:] = lb.keys[:k]
        la.values[h, :, width - w:] = lb.values[:k]


def _close_holes(holes, cache, rows, step, u_rows, logits, attn, pos):
    """Drop the batch rows ``holes`` (ended rows kept for reuse) from the cache and every per-row tensor."""
    keep = torch.ones(rows.numel(), dtype=torch.bool)
    keep[holes] = False
    keep = keep.nonzero().squeeze(1)
    cache.batch_select_indices(keep.to(attn.device))
    return (rows[keep], step[keep], None if u_rows is None else u_rows[keep], logits[keep.to(logits.device)],
            attn[keep.to(attn.device)], pos[keep.to(pos.device)])


def _leading_rows_of_one_prompt(pending: deque) -> int:
    """How many rows at the head of ``pending`` (``(prompt, sample)`` pairs) belong to its first prompt."""
    first, k = pending[0][0], 0
    for i, _ in pending:
        if i != first:
            break
        k += 1
    return k


class _Piece(NamedTuple):
    rows: list[tuple[int, int]]   # (prompt, sample) of each row
    cache: object                 # the rows' own KV cache (prompt positions)
    logits: torch.Tensor          # (rows, V) next-token logits after the prompt
    attn: torch.Tensor            # (rows, W) attention mask of the prompt columns
    pos: torch.Tensor             # (rows, 1) position id of the last prompt token


class _Prefills:
    """Prompts prefilled and kept until their last row is admitted (a prompt's rows may start at
    different decode steps when groups are split across slots)."""

    def __init__(self, decoder, head, config, prompts, n: int, pad_id, device, share_prefix: bool,
                 chunk: int) -> None:
        self.decoder, self.head, self.config, self.prompts, self.n = decoder, head, config, prompts, n
        self.pad_id, self.device, self.share_prefix, self.chunk = pad_id, device, share_prefix, chunk
        self.held: dict[int, tuple[dict, int]] = {}   # prompt -> (prefill batch, its row there)
        self.left: dict[int, int] = {}                 # prompt -> rows not yet admitted

    def admit(self, take: list[tuple[int, int]], pending: deque) -> list[_Piece]:
        """The rows ``take`` as pieces, one per prefill batch they come from (in order)."""
        if not take:
            return []
        missing = [i for i in dict.fromkeys(i for i, _ in take) if i not in self.held]
        if missing:
            ahead = [i for i in dict.fromkeys(i for i, _ in pending) if i not in self.held and i not in missing]
            self._prefill(missing + ahead[:max(0, self.chunk - len(missing))])
        pieces: list[_Piece] = []
        by_batch: dict[int, tuple[dict, list[int], list[tuple[int, int]]]] = {}
        for i, s in take:
            batch, j = self.held[i]
            by_batch.setdefault(id(batch), (batch, [], []))
            by_batch[id(batch)][1].append(j)
            by_batch[id(batch)][2].append((i, s))
            self.left[i] -= 1
            if self.left[i] == 0:
                del self.held[i], self.left[i]
        for batch, js, rows in by_batch.values():
            idx = torch.tensor(js, dtype=torch.long, device=batch["logits"].device)
            pieces.append(_Piece(rows, select_rows(batch["cache"], idx), batch["logits"][idx],
                                 batch["attn"][idx], batch["pos"][idx]))
        return pieces

    def _prefill(self, members: list[int]) -> None:
        layout = layout_prompts([self.prompts[i] for i in members], self.pad_id, self.device, self.share_prefix)
        hidden, cache = encode_prompts(self.decoder, layout)
        batch = dict(cache=cache, logits=final_logits(self.config, self.head(hidden[:, -1])),
                     attn=layout.attention_mask, pos=layout.position_ids[:, -1:])
        for j, i in enumerate(members):
            self.held[i] = (batch, j)
            self.left[i] = self.n


def select_rows(cache, idx: torch.Tensor):
    """A new cache holding the rows ``idx`` of ``cache`` (which is unchanged)."""
    layers = getattr(cache, "layers", None)
    if not layers or any(getattr(layer, "keys", None) is None or layer.keys.dim() != 4 for layer in layers):
        out = copy.deepcopy(cache)  # a cache of another kind: its own row selection
        out.batch_select_indices(idx)
        return out
    out = copy.copy(cache)
    out.layers = []
    for layer in cache.layers:
        new = copy.copy(layer)
        new.keys, new.values = layer.keys.index_select(0, idx), layer.values.index_select(0, idx)
        for buf in ("_kbuf", "_vbuf"):
            if buf in new.__dict__:
                setattr(new, buf, None)
        out.layers.append(new)
    return out


def _group_draws(draws: dict, g: int, groups, seeds, n: int, T: int) -> torch.Tensor:
    """Group ``g``'s ``(T, len(groups[g]) * n)`` uniforms, drawn on first use."""
    if g not in draws:
        gen = torch.Generator(device="cpu").manual_seed(int(seeds[g]))
        draws[g] = torch.rand(T, len(groups[g]) * n, generator=gen, dtype=torch.float64)
    return draws[g]
