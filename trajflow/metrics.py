"""verl's data metrics of an iteration's joined batch (scores, advantages, lengths, tokens)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from trajflow.stages.multi_turn import multi_turn_metrics
from trajflow.metric_names import metric_name
from trajflow.stages.pass_at_k import best_at_k, maj_at_k, pass_at_k, verl_ks
from trajflow.batch import lengths, trainable_lengths, trainable_mask_array


#: verl's stages whose wall time is also reported per token (``timing_per_token_ms/<stage>``), and which
#: tokens they are divided by (verl's ``compute_timing_metrics``): generation by the response tokens,
#: the others (forward/backward passes over whole sequences) by prompt + response tokens.
TIMING_PER_TOKEN_STAGES = {"gen": "response", "ref": "all", "values": "all", "adv": "all",
                           "update_critic": "all", "update_actor": "all"}


def batch_metrics(joined: pa.Table) -> dict[str, float]:
    """verl's data metrics over one iteration's joined batch (``response_length/mean_terminated``: the
    mean length of the responses that ended by themselves, ``finish_reason != "length"``; absent when
    every response was truncated)."""
    score = joined.column("score").to_numpy(zero_copy_only=False).astype(np.float64)
    resp_len = lengths(joined.column("response_ids"))
    prompt_len = lengths(joined.column("prompt_ids"))
    m: dict[str, float] = {}

    def stats(prefix: str, x: np.ndarray) -> None:
        finite = x[np.isfinite(x)]
        if len(finite):
            m[f"{prefix}/mean"] = float(finite.mean())
            m[f"{prefix}/max"] = float(finite.max())
            m[f"{prefix}/min"] = float(finite.min())

    stats("critic/score", score)
    if "token_rewards" in joined.column_names:
        tr = joined.column("token_rewards")
        stats("critic/rewards", np.array([float(np.sum(r)) if r is not None else 0.0 for r in tr.to_pylist()]))
    # Token statistics over the generated tokens only: observation tokens of a multi-turn row carry
    # no advantage, return or value of their own (stored as 0), and would pull the means to 0.
    keep = None
    if "loss_mask" in joined.column_names:
        generated = trainable_mask_array(joined)
        keep = generated[np.arange(generated.shape[1])[None, :] < resp_len[:, None]]  # in flattened ragged order
    for col, name in (("advantages", "critic/advantages"), ("returns", "critic/returns"), ("values", "critic/values")):
        if col in joined.column_names:
            flat = joined.column(col).combine_chunks().flatten().to_numpy(zero_copy_only=False)
            stats(name, (flat if keep is None else flat[keep]).astype(np.float64))
    # verl's response_length counts every response token (a multi-turn row's tool output included);
    # response_length_trainable counts the tokens the policy generated and is trained on.
    stats("response_length", resp_len.astype(np.float64))
    if keep is not None:
        stats("response_length_trainable", trainable_lengths(joined).astype(np.float64))
    stats("prompt_length", prompt_len.astype(np.float64))
    fr = joined.column("finish_reason").to_pylist()
    m["response_length/clip_ratio"] = float(np.mean([f == "length" for f in fr])) if fr else 0.0
    ended = np.array([f != "length" for f in fr], dtype=bool)
    if ended.any():  # the responses that ended by themselves (EOS / stop), truncated ones left out
        m["response_length/mean_terminated"] = float(resp_len[ended].mean())
    total = resp_len + prompt_len
    m["global_seqlen/min"] = float(total.sum())
    m["global_seqlen/max"] = float(total.sum())
    m["global_seqlen/minmax_diff"] = 0.0
    m["perf/total_num_tokens"] = float(total.sum())
    if "reward_error" in joined.column_names:
        m["reward/scorer_errors"] = float(joined.column("reward_error").null_count * -1 + joined.num_rows)
    m.update(multi_turn_metrics(joined))  # tool/* and num_turns/*, multi-turn rows only
    return m


def timing_per_token_metrics(timings: dict, joined: pa.Table) -> dict[str, float]:
    """verl's ``timing_per_token_ms/<stage>``: ``1000 * timing_s/<stage> / tokens``, with tokens the
    batch's response tokens for ``gen`` and its prompt + response tokens for ``ref``, ``values``,
    ``adv``, ``update_critic`` and ``update_actor`` (:data:`TIMING_PER_TOKEN_STAGES`).

    Args:
        timings: metrics holding ``timing_s/<stage>`` seconds (others are ignored).
        joined: the iteration's rows (``prompt_ids``, ``response_ids``).

    Returns:
        One entry per stage that has a timing, in milliseconds per token (none without tokens).
    """
    resp = float(lengths(joined.column("response_ids")).sum())
    total = resp + float(lengths(joined.column("prompt_ids")).sum())
    out = {}
    for stage, which in TIMING_PER_TOKEN_STAGES.items():
        seconds = timings.get(f"timing_s/{stage}")
        n = resp if which == "response" else total
        if seconds is not None and n > 0:
            out[f"timing_per_token_ms/{stage}"] = float(seconds) * 1000.0 / n
    return out


def validation_metrics(data_sources: list[str], scores: np.ndarray, extras: list, response_ids: list[list[int]],
                       n: int) -> dict[str, float]:
    """verl's validation metrics of ``n`` responses per held-out prompt.

    Rows come prompt by prompt: rows ``k*n .. k*n+n-1`` are the ``n`` responses to prompt ``k``.

    Args:
        data_sources: per row.
        scores: ``(rows,)`` the scorers' scores.
        extras: per-row scorer extras; a row's accuracy is its ``acc`` extra where the scorer reports
            one, else its score; its final answer (for the vote) is its ``extracted`` extra.
        response_ids: per-row response token ids.
        n: responses per prompt (the ``@n`` of the names).

    Returns:
        Names in verl's layout, spelled by :func:`trajflow.metric_names.metric_name` (``@`` as ``_at_``,
        verl's MLflow spelling, and ``<source>`` with characters MLflow rejects as ``_``): the same name on
        the console, in ``run.json`` and in MLflow. Below, ``@`` stands for that ``_at_``.
        ``val-core/<source>/acc/mean@<n>`` (accuracy averaged over all rows),
        ``val-aux/<source>/reward/mean@<n>`` and ``val-aux/response_length/mean`` (tokens); with ``n > 1``
        also, averaged over prompts (:mod:`trajflow.stages.pass_at_k`, each the exact expectation over the
        k-subsets of a prompt's ``n`` responses, not a bootstrap):
        ``val-core/<source>/acc/pass@<k>/mean`` for every ``1 <= k <= n`` (Chen et al. 2021, Eq. 1:
        ``1 - C(n - c, k) / C(n, k)``, a response correct when its accuracy is >= 1);
        ``val-core/<source>/acc/best@<k>/mean`` (expected best accuracy of k responses) and
        ``val-core/<source>/acc/maj@<k>/mean`` (majority voting, Wang et al. 2023 "Self-Consistency",
        Sec. 2: per subset the most frequent stated answer wins, ties to the one stated first, and the
        subset scores that answer's accuracy; 0 when no response states one; absent for a source whose
        scorer reports no ``extracted`` answer, e.g. a multi-turn ``env_reward``) for verl's k: 2, 4,
        8, ... below ``n`` and ``n`` (at ``k = n``: the best of the ``n`` accuracies and the vote of all).

    Raises:
        ValueError: the number of rows is not a multiple of ``n``.
    """
    metrics: dict[str, float] = {}
    if len(scores) % n:
        raise ValueError(f"validation_metrics: {len(scores)} rows is not a multiple of rollout.val_n={n}")
    sources = np.array(data_sources)
    acc = np.array([float(e.get("acc", s)) if isinstance(e, dict) else float(s) for e, s in zip(extras, scores)])
    for src in sorted(set(sources)):
        sel = sources == src
        metrics[metric_name(f"val-core/{src}/acc/mean@{n}")] = float(np.nanmean(acc[sel]))
        metrics[metric_name(f"val-aux/{src}/reward/mean@{n}")] = float(np.nanmean(scores[sel]))
    if n > 1:
        groups = [range(k, k + n) for k in range(0, len(scores), n)]
        for src in sorted(set(sources)):
            mine = [g for g in groups if sources[g[0]] == src]
            votes = any(isinstance(extras[i], dict) and "extracted" in extras[i] for g in mine for i in g)
            correct = [int(np.sum(acc[list(g)] >= 1.0)) for g in mine]
            for k in range(1, n + 1):
                pass_k = float(np.mean([pass_at_k(n, c, k) for c in correct]))
                metrics[metric_name(f"val-core/{src}/acc/pass@{k}/mean")] = pass_k
            for k in verl_ks(n):
                if votes:
                    maj = [maj_at_k([extras[i] for i in g], acc[list(g)], k) for g in mine]
                    metrics[metric_name(f"val-core/{src}/acc/maj@{k}/mean")] = float(np.mean(maj))
                best = float(np.mean([best_at_k(acc[list(g)], k) for g in mine]))
                metrics[metric_name(f"val-core/{src}/acc/best@{k}/mean")] = best
    metrics["val-aux/response_length/mean"] = float(np.mean([len(r) for r in response_ids]))
    return metrics

