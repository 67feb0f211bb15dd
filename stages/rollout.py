"""Rollout math: sampling parameters, the generation result, response masks, finish reasons and
per-token log-probs.

Plain tensor functions used by the rollout engines and the policy worker. No Ray, no Prefect.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import pyarrow as pa
import torch

from trajflow.batch import PROMPT_TYPE, list_column, nested_column


@dataclass(frozen=True)
class SamplingParams:
    """How responses are sampled.

    Attributes:
        n: samples per prompt (the group size).
        temperature: softmax temperature (> 0); 0 means greedy decoding.
        top_p: nucleus mass in (0, 1].
        top_k: keep the k most likely tokens (0 = off).
        max_new_tokens: response length cap, in tokens.
        seed: seed of the sampling RNG (responses are a function of the prompts, weights and seed).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 32
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class Generation:
    """What a rollout returns: ``len(prompts) * n`` rows, prompt-major (prompt 0's ``n`` samples first).

    Attributes:
        response_ids: each row's response token ids, cut after the first EOS (EOS included).
        response_text: each row's response decoded without special tokens.
        finish_reason: ``"stop"`` (ended with an EOS) or ``"length"`` (cut at the length cap) per row.
        rollout_logprobs: the behaviour policy's log-probs: each response token's log-prob under the
            rollout engine's ``softmax(logits / temperature)`` at the sampling temperature (raw tempered,
            before top-k/top-p); ``None`` for greedy decoding.
        policy_version: the version of the weights that generated (updates applied so far).
        timing: seconds, ``timing_s/gen`` and, when the log-probs were recomputed teacher-forced,
            ``timing_s/old_log_prob``.
    """

    response_ids: list[list[int]]
    response_text: list[str]
    finish_reason: list[str]
    rollout_logprobs: list[list[float]] | None
    policy_version: int
    timing: dict[str, float] = field(default_factory=dict)


def response_mask(response_ids: torch.Tensor, eos_ids: Sequence[int]) -> torch.Tensor:
    """Mask of the real response tokens: everything up to and including the first EOS.

    Padding after the first EOS is excluded even when the pad id equals an EOS id (SmolLM2 uses
    ``<|im_end|>`` for both), because only the *first* EOS counts. A response without EOS is kept
    whole (it was cut at ``max_new_tokens``).

    Args:
        response_ids: ``(batch, response_len)`` int64, right-padded generated tokens.
        eos_ids: token ids that end a response.

    Returns:
        ``(batch, response_len)`` bool mask.
    """
    is_eos = torch.isin(response_ids, torch.as_tensor(list(eos_ids), dtype=response_ids.dtype))
    # Number of EOS strictly before each position; a position is real iff that number is 0.
    eos_before = torch.cumsum(is_eos.to(torch.int64), dim=-1) - is_eos.to(torch.int64)
    return eos_before == 0


def response_lengths_and_finish(response_ids: torch.Tensor, eos_ids: Sequence[int]) -> tuple[torch.Tensor, list[str]]:
    """Valid length of each response (EOS included) and its finish reason.

    Args:
        response_ids: ``(batch, response_len)`` int64.
        eos_ids: token ids that end a response.

    Returns:
        ``lengths`` ``(batch,)`` int64 and a list of ``"stop"`` (ended with EOS) or ``"length"``
        (cut at the length cap) per row.
    """
    mask = response_mask(response_ids, eos_ids)
    lengths = mask.sum(-1)
    is_eos = torch.isin(response_ids, torch.as_tensor(list(eos_ids), dtype=response_ids.dtype))
    stopped = (is_eos & mask).any(-1)
    return lengths, ["stop" if s else "length" for s in stopped.tolist()]


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0,
                         chunk_size: int = 0) -> torch.Tensor:
    """Log-probability of ``labels`` under ``softmax(logits / temperature)``.

    The temperature must be the one used for sampling, or the importance ratio of the first PPO
    step is not 1 (Schulman et al. 2017 assume log-probs of the behaviour policy).

    Args:
        logits: ``(..., vocab)`` float.
        labels: ``(...)`` int64.
        temperature: > 0.
        chunk_size: rows of the flattened batch processed at a time (0 = all at once) to bound the
            ``(rows, vocab)`` float32 temporaries of log-softmax.

    Returns:
        ``(...)`` float32 log-probs.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for log-probs, got {temperature}")
    flat = logits.reshape(-1, logits.shape[-1])
    flat_labels = labels.reshape(-1)
    step = chunk_size or flat.shape[0] or 1
    out = []
    for i in range(0, flat.shape[0], step):
        x = flat[i:i + step].float()
        if temperature != 1.0:
            x = x / temperature
        picked = torch.gather(x, -1, flat_labels[i:i + step, None]).squeeze(-1)
        out.append(picked - torch.logsumexp(x, dim=-1))
    return torch.cat(out).reshape(labels.shape) if out else flat.new_zeros(labels.shape)


def sample_tokens(logits: torch.Tensor, temperature: float, uniform: torch.Tensor, top_p: float = 1.0,
                  top_k: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row by inverting the CDF of the tempered, filtered distribution.

    The distribution is ``softmax(logits / temperature)`` restricted to the ``top_k`` most likely
    tokens (0 = all) and then to the smallest set of most likely tokens whose mass reaches ``top_p``
    (nucleus sampling, Holtzman et al. 2020, "The Curious Case of Neural Text Degeneration", Sec. 3.1),
    renormalised. Row ``i`` gets the first token whose cumulative probability (float64, in vocabulary
    order) exceeds ``uniform[i]`` times the kept mass. One uniform draw per row replaces
    ``torch.multinomial``'s vocabulary-sized exponential draws (51 ms of a 0.48 s decoding step at
    32 rows x 49k vocabulary on CPU); a row's token depends only on its own logits and draw.

    Args:
        logits: ``(b, vocab)`` float, raw (un-tempered) next-token logits.
        temperature: > 0.
        uniform: ``(b,)`` float in ``[0, 1)``.
        top_p: nucleus mass in ``(0, 1]``.
        top_k: keep the ``top_k`` most likely tokens; 0 keeps all.

    Returns:
        ``tokens`` ``(b,)`` int64 and their log-probs ``(b,)`` float32 under the *unfiltered*
        ``softmax(logits / temperature)``: what the trainer recomputes teacher-forced, so the first
        on-policy importance ratio is 1 whatever the filter.

    Raises:
        ValueError: ``temperature <= 0``, ``top_p`` outside ``(0, 1]``, ``top_k < 0``, or ``uniform``
            not of shape ``(b,)``.
    """
    if temperature <= 0:
        raise ValueError(f"sample_tokens: temperature must be > 0, got {temperature} (greedy decoding is argmax)")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"sample_tokens: top_p must be in (0, 1], got {top_p}")
    if top_k < 0:
        raise ValueError(f"sample_tokens: top_k must be >= 0, got {top_k}")
    if uniform.shape != logits.shape[:1]:
        raise ValueError(f"sample_tokens: uniform must have shape {tuple(logits.shape[:1])}, got {tuple(uniform.shape)}")
    x = logits.float()
    if temperature != 1.0:  # dividing by 1 changes nothing but costs a pass over the vocabulary
        x = x / temperature
    logz = torch.logsumexp(x, dim=-1, keepdim=True)
    probs = torch.exp(x - logz)
    kept = probs
    if 0 < top_k < x.shape[-1]:
        kth = torch.topk(x, top_k, dim=-1).values[:, -1:]
        kept = kept.masked_fill(x < kth, 0.0)
    if top_p < 1.0:
        sorted_p, order = torch.sort(kept, dim=-1, descending=True)
        mass_before = sorted_p.cumsum(-1) - sorted_p
        drop_sorted = mass_before >= top_p * sorted_p.sum(-1, keepdim=True)
        kept = kept.masked_fill(torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted), 0.0)
    cdf = kept.double().cumsum(-1)
    target = uniform.to(cdf.device, torch.float64)[:, None] * cdf[:, -1:]
    tokens = torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp(max=x.shape[-1] - 1)
    logprobs = (x.gather(-1, tokens[:, None]) - logz).squeeze(-1)
    return tokens, logprobs


def sample_ids(iteration: int, num_prompts: int, n: int, offset: int = 0) -> tuple[list[str], list[str]]:
    """``sample_id`` and ``group_id`` per row, prompt-major: ``it000003-p0005-s2`` / ``it000003-p0005``.

    ``offset`` numbers the prompts from ``offset`` on (the later generation batches of dynamic
    sampling continue the numbering, so ids stay unique within an iteration).
    """
    groups = [f"it{iteration:06d}-p{j:04d}" for j in range(offset, offset + num_prompts) for _ in range(n)]
    samples = [f"{g}-s{k}" for g, k in zip(groups, [k for _ in range(num_prompts) for k in range(n)])]
    return samples, groups


def rollout_table(iteration: int, prompts: Sequence[Any], prompt_ids: Sequence[Sequence[int]], gen: Generation,
                  n: int, offset: int = 0, extra_info_type: pa.DataType | None = None) -> pa.Table:
    """The rollout stage's output. ``prompt`` (chat messages, :data:`trajflow.batch.PROMPT_TYPE`) and
    ``extra_info`` are Arrow lists and structs, not JSON text.

    Args:
        iteration: iteration number.
        prompts: ``PromptRecord`` per prompt (``prompt_id``, ``data_source``, ``messages``,
            ``ground_truth``, ``extra_info``).
        prompt_ids: token ids per prompt.
        gen: the policy worker's ``generate_sequences`` result (``n`` rows per prompt, prompt-major).
        n: samples per prompt.
        offset: number of the first prompt (see :func:`sample_ids`).
        extra_info_type: the ``extra_info`` struct type, inferred once for the whole dataset
            (``PromptDatasets.extra_info_type``) so that every iteration's file has the same schema;
            None infers it from these prompts.
    """
    sids, gids = sample_ids(iteration, len(prompts), n, offset)
    rep = [p for p in prompts for _ in range(n)]
    rep_ids = [ids for ids in prompt_ids for _ in range(n)]
    cols = {
        "sample_id": pa.array(sids, pa.string()),
        "prompt_id": pa.array([str(p.prompt_id) for p in rep], pa.string()),
        "group_id": pa.array(gids, pa.string()),
        "iteration": pa.array([iteration] * len(sids), pa.int64()),
        "policy_version": pa.array([int(gen.policy_version)] * len(sids), pa.int64()),
        "prompt": pa.array([p.messages for p in rep], PROMPT_TYPE),
        "prompt_ids": list_column(rep_ids, pa.int32()),
        "response_ids": list_column(gen.response_ids, pa.int32()),
        "response_text": pa.array(gen.response_text, pa.string()),
        "rollout_logprobs": list_column(gen.rollout_logprobs or [[] for _ in sids], pa.float32()),
        "finish_reason": pa.array(gen.finish_reason, pa.string()),
        "ground_truth": pa.array([str(p.ground_truth) for p in rep], pa.string()),
        "data_source": pa.array([p.data_source for p in rep], pa.string()),
        "extra_info": nested_column([p.extra_info for p in rep], extra_info_type),
    }
    return pa.table(cols)


#: The sampling settings stored on every rollout row (schema 3): the temperature every later stage
#: computes log-probs at (reference, trainer's old and current), whatever a later config (a replay's)
#: says. verl carries it on the batch (``meta_info["temperature"]``), prime-rl per token.
SAMPLING_COLUMNS = ("temperature", "top_p", "top_k")


def with_sampling_columns(table: pa.Table, params: SamplingParams) -> pa.Table:
    """``table`` with the ``temperature`` (float64), ``top_p`` (float64) and ``top_k`` (int32) the rows
    were sampled with appended (float64: the stored value is the config's exactly, so log-probs
    recomputed from it match the sampler's bit for bit)."""
    rows = table.num_rows
    return (table.append_column("temperature", pa.array([float(params.temperature)] * rows, pa.float64()))
            .append_column("top_p", pa.array([float(params.top_p)] * rows, pa.float64()))
            .append_column("top_k", pa.array([int(params.top_k)] * rows, pa.int32())))


def rollout_temperature(table: pa.Table, default: float) -> float:
    """The sampling temperature of a rollout table's rows: its ``temperature`` column, or ``default``
    (the run config's ``rollout.temperature``) for a file written before schema 3, which did not store it.

    Raises:
        ValueError: the rows were sampled at more than one temperature, or at 0 (greedy rows have no
            behaviour log-probs to train on).
    """
    if "temperature" not in table.column_names or table.num_rows == 0:
        return float(default)
    values = set(table.column("temperature").to_pylist())
    if len(values) != 1:
        raise ValueError(f"rollout rows were sampled at several temperatures {sorted(values)}; one batch needs one")
    t = float(values.pop())
    if not t > 0:
        raise ValueError(f"rollout rows were sampled at temperature {t}: training needs a temperature > 0")
    return t


def baseline_columns(prompt_rows: Sequence[int], greedy: Generation) -> dict[str, pa.Array]:
    """ReMax's greedy baseline responses as rollout columns (one greedy response per prompt, repeated on
    every row of the prompt's group).

    Args:
        prompt_rows: for each row, the index of its prompt in ``greedy``'s order.
        greedy: ``generate_sequences`` output with one greedy response per prompt.
    """
    ids = [greedy.response_ids[k] for k in prompt_rows]
    return {"baseline_response_ids": list_column(ids, pa.int32()),
            "baseline_response_text": pa.array([greedy.response_text[k] for k in prompt_rows], pa.string())}


def sampling_params(rollout_cfg: Any, seed: int, *, n: int | None = None, temperature: float | None = None,
                    top_p: float | None = None, top_k: int | None = None) -> SamplingParams:
    """Sampling parameters from the ``rollout`` config section (attributes or keys), with overrides.

    Args:
        rollout_cfg: the ``rollout`` section (``n``, ``temperature``, ``top_p``, ``top_k``, ``max_new_tokens``).
        seed: the generation's seed (:func:`trajflow.stages.seeds.iteration_seed`).
        n, temperature, top_p, top_k: replace the section's value (validation, greedy baselines).
    """
    def get(key: str):
        return rollout_cfg[key] if isinstance(rollout_cfg, dict) else getattr(rollout_cfg, key)

    return SamplingParams(n=get("n") if n is None else n, temperature=get("temperature") if temperature is None else temperature,
                          top_p=get("top_p") if top_p is None else top_p, top_k=get("top_k") if top_k is None else top_k,
                          max_new_tokens=get("max_new_tokens"), seed=seed)
