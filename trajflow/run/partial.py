"""One segment of partial rollouts (``trainer.partial_rollout``): continue the pool, start the iteration's
prompts, generate in chunks until the iteration has its groups, store what stays in flight.

The pool and its rules are :mod:`trajflow.stages.partial_rollout`; which version a segment runs and
when its weights load are the schedule's (:mod:`trajflow.run.schedule`). The engine sees only the
contract's ``generate`` (token ids in, ``max_new_tokens`` per call): a paused row continues as a new
request whose prompt is its prompt plus its response so far (its KV cache is computed again under the
new weights), with the budget it has left. Any engine that takes token ids can therefore resume rows,
the vLLM one as well as the HF one.

What determinism requires (a crashed run resumes to the same bytes):

- every pause point is counted, never timed: a segment stops at the first chunk boundary (after at
  least one chunk, while any row runs) where it has ``data.train_batch_size`` complete groups and every
  group that could not wait for the next update is complete; a chunk is
  ``rollout.partial_chunk_tokens`` decode steps;
- each chunk's samples are a function of its rows' token ids, the weights and a seed derived from the
  iteration's seed and the chunk's number (:func:`~trajflow.stages.partial_rollout.chunk_seed`): the
  engine contract's own promise;
- the version each segment runs is fixed by the schedule when it is submitted, as for overlapped rollouts;
- the rows in flight after a segment are stored with their tokens so far, log-probs and versions
  (``inflight.parquet``, Arrow), and the next segment reads them from there, so a resume never needs
  the process that paused them.
"""

from __future__ import annotations

import time
from collections import defaultdict

import pyarrow as pa

from trajflow.stages import partial_rollout as pr
from trajflow.stages.rollout import Generation, SamplingParams, rollout_table, with_sampling_columns
from trajflow.faults import fault_point
from trajflow.run import roles
from trajflow.run.context import RunContext
from trajflow.run.recovery import wait

#: The stored pool of rows in flight after an iteration's segment (``inflight.parquet``).
INFLIGHT = "inflight"


def max_model_len(ctx: RunContext) -> int | None:
    """The policy's context length (``max_position_embeddings`` of its config), None if it has none."""
    from transformers import AutoConfig

    n = getattr(AutoConfig.from_pretrained(str(ctx.model_path)), "max_position_embeddings", None)
    return int(n) if n else None


def carried_pool(ctx: RunContext, iteration: int) -> pa.Table | None:
    """The rows the segment before ``iteration`` left in flight, or None for the first iteration.

    Raises:
        StoreError: the previous iteration's ``inflight.parquet`` is missing or does not verify.
    """
    if iteration <= 1:
        return None
    return ctx.store.read_stage(iteration - 1, INFLIGHT)


def run_segment(ctx: RunContext, iteration: int, params: SamplingParams) -> tuple[pa.Table, int]:
    """Generate iteration ``iteration``'s segment on the rollout workers and store its in-flight rows.

    Args:
        ctx: the run.
        iteration: the iteration (its ``IterationState`` holds the new prompts, the version to load and
            the trainer's version at its update, ``use_version``).
        params: the iteration's sampling settings (``n``, temperature, filters, ``max_new_tokens``, seed).

    Returns:
        ``(rows, version)``: the iteration's rollout rows (complete groups, ``token_policy_versions``
        included) and the policy version the segment ran.
    """
    cfg, state = ctx.cfg, ctx.iteration(iteration)
    if state.behaviour_weights is not None:  # the segments ahead of this one are done: its weights now
        state.timing["timing_s/weight_load"] = roles.load_rollout_weights(ctx, state.behaviour_weights,
                                                                          state.behaviour_version, iteration)
    t0 = time.perf_counter()
    carried = carried_pool(ctx, iteration)
    prompt_ids = wait(ctx, ctx.rollout.tokenize_prompts.remote([p.messages for p in state.prompts],
                                                               cfg.data.max_prompt_length))
    empty = Generation(response_ids=[[] for _ in range(len(prompt_ids) * params.n)],
                       response_text=[""] * (len(prompt_ids) * params.n), finish_reason=["length"] * (len(prompt_ids) * params.n),
                       rollout_logprobs=None, policy_version=-1)
    entering = pr.new_pool_rows(with_sampling_columns(rollout_table(
        iteration, state.prompts, prompt_ids, empty, params.n, extra_info_type=ctx.datasets.extra_info_type), params))
    pool = pr.concat_pools([carried, entering])
    n_max, use = int(cfg.trainer.max_staleness), int(state.use_version)
    groups, chunk = int(cfg.data.train_batch_size), pr.chunk_size(cfg.rollout.partial_chunk_tokens, params.max_new_tokens)
    context = max_model_len(ctx)
    version, chunks, prefill = int(state.behaviour_version), 0, 0
    # At least one chunk while any row runs: the rollout workers advance the pool even when the groups
    # this iteration takes were complete already (generation never idles a whole segment).
    while (chunks == 0 and not pr.finished(pool).all()) or \
            not pr.segment_done(pool, groups, pr.must_finish_groups(pool, use + 1, n_max)):
        requests = pr.chunk_requests(pool, chunk, params.max_new_tokens, context)
        by_budget: dict[int, list[pr.ChunkRequest]] = defaultdict(list)
        for r in requests:
            by_budget[r.budget].append(r)
        for budget in sorted(by_budget):
            reqs = by_budget[budget]
            call = SamplingParams(n=1, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                                  max_new_tokens=budget, seed=pr.chunk_seed(params.seed, chunks, budget))
            pending = ctx.rollout.generate.remote([r.token_ids for r in reqs], call)
            fault_point("rollout", iteration)
            gen = wait(ctx, pending)
            if gen.rollout_logprobs is None:
                raise RuntimeError(f"rollout.engine={cfg.rollout.engine!r} returned no log-probs: partial rollouts "
                                   f"store the behaviour policy's log-prob of every token")
            version = int(gen.policy_version)
            prefill += sum(len(r.token_ids) for r in reqs)
            pool = pr.apply_chunk(pool, [r.row for r in reqs], gen.response_ids, gen.rollout_logprobs,
                                  gen.finish_reason, version, params.max_new_tokens, context)
        if not requests:  # rows with no budget left: apply_chunk ends them
            pool = pr.apply_chunk(pool, [], [], [], [], version, params.max_new_tokens, context)
        chunks += 1
    texts = wait(ctx, ctx.rollout.detokenize.remote(pool.column("response_ids").to_pylist()))
    batch, rest = pr.take_batch(pool, groups, iteration, use, n_max, texts)
    state.timing["timing_s/gen"] = time.perf_counter() - t0
    metrics = {
        "rollout/partial/chunks": float(chunks),
        "rollout/partial/prefill_tokens": float(prefill),  # prompt + response tokens prefilled for the chunks
        "rollout/partial/carried_rows": float(0 if carried is None else carried.num_rows),
        "rollout/partial/inflight_rows": float(rest.num_rows),
        "rollout/partial/inflight_started_rows": float(sum(1 for v in rest.column(pr.TOKEN_VERSIONS).to_pylist() if v)),
    }
    state.rollout_metrics.update(metrics)
    # Before the rollout file: a stored rollout is reused only with its pool stored (the next segment reads it).
    ctx.store.write_stage(iteration, INFLIGHT, rest, version, meta={"metrics": metrics})
    return batch, version


def restore_segment_metrics(ctx: RunContext, iteration: int) -> None:
    """A stored segment is reused (resume): put its ``rollout/partial/*`` metrics back in the iteration."""
    entry = ctx.store.stage_entry(iteration, INFLIGHT) or {}
    ctx.iteration(iteration).rollout_metrics.update(entry.get("meta", {}).get("metrics", {}))
