"""Sample-set metrics of validation: unbiased pass@k, best@k and maj@k of ``n`` responses per prompt.

With ``n`` responses to a prompt and ``k <= n``, each metric is the expectation, over the ``C(n, k)``
subsets of ``k`` of those responses drawn without replacement, of a statistic of the subset, so one
set of ``n`` samples estimates the value for every ``k`` without bias (no bootstrap):

- pass@k (Chen et al. 2021, "Evaluating Large Language Models Trained on Code", Eq. 1):
  ``1 - C(n - c, k) / C(n, k)`` with ``c`` correct responses: the probability that a subset holds at
  least one correct response;
- best@k: the expected best accuracy of a subset. With the accuracies sorted ascending
  ``a_(1) <= ... <= a_(n)``, ``a_(i)`` is a subset's maximum when the subset holds ``i`` and
  ``k - 1`` of the ``i - 1`` below it: ``sum_i a_(i) C(i - 1, k - 1) / C(n, k)`` (for 0/1 accuracies
  this is pass@k);
- maj@k: the expected accuracy of a subset's majority answer (Wang et al. 2023, "Self-Consistency",
  Sec. 2), the mean over every subset when there are at most :data:`MAJ_EXACT_SUBSETS`, else over
  that many subsets drawn uniformly with a fixed seed (an unbiased estimate, deterministic).

verl's names: ``best@k/mean``, ``maj@k/mean`` for k in 2, 4, 8, ... below ``n`` and ``n`` itself
(:func:`verl_ks`). Plain functions; no Ray, no Prefect.
"""

from __future__ import annotations

import itertools
import math
from typing import Sequence

import numpy as np

__all__ = ["MAJ_EXACT_SUBSETS", "best_at_k", "maj_at_k", "majority_accuracy", "pass_at_k", "verl_ks"]

#: maj@k enumerates every k-subset up to this many, else averages this many drawn subsets.
MAJ_EXACT_SUBSETS = 4096


def _check(n: int, k: int) -> None:
    if not (isinstance(n, int) and isinstance(k, int) and 1 <= k <= n):
        raise ValueError(f"pass@k needs integers 1 <= k <= n, got n={n!r}, k={k!r}")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt: ``1 - C(n - c, k) / C(n, k)`` (Chen et al. 2021, Eq. 1).

    Args:
        n: responses sampled for the prompt.
        c: how many of them are correct (``0 <= c <= n``).
        k: subset size, ``1 <= k <= n``.

    Returns:
        The probability in [0, 1] that ``k`` responses drawn without replacement hold a correct one
        (exact integer arithmetic, then one division).

    Raises:
        ValueError: ``k`` outside ``[1, n]`` or ``c`` outside ``[0, n]``.
    """
    _check(n, k)
    if not (isinstance(c, int) and 0 <= c <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n={n}, got c={c!r}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def best_at_k(acc: Sequence[float] | np.ndarray, k: int) -> float:
    """Expected best accuracy of ``k`` of the ``n`` responses drawn without replacement.

    ``sum_i a_(i) C(i - 1, k - 1) / C(n, k)`` over the accuracies sorted ascending (i from 1).

    Args:
        acc: ``(n,)`` the responses' accuracies (a NaN counts as 0).
        k: subset size, ``1 <= k <= n``.

    Returns:
        The expectation (``k = 1``: the mean; ``k = n``: the maximum).

    Raises:
        ValueError: ``k`` outside ``[1, n]``.
    """
    a = np.sort(np.nan_to_num(np.asarray(acc, dtype=np.float64), nan=0.0))
    n = len(a)
    _check(n, k)
    total = math.comb(n, k)
    return float(sum(a[i] * math.comb(i, k - 1) for i in range(k - 1, n)) / total)


def majority_accuracy(extras: Sequence, acc: Sequence[float] | np.ndarray) -> float:
    """The accuracy of one set's majority answer: the most frequent ``extracted`` answer (stripped),
    ties to the one stated first; responses with no stated answer do not vote; 0 when none does.

    Args:
        extras: per response, the scorer's extras (a dict with ``extracted``, or anything else).
        acc: per response, its accuracy.
    """
    votes: dict[str, list[float]] = {}
    for e, a in zip(extras, acc):
        answer = e.get("extracted") if isinstance(e, dict) else None
        if answer is None or not str(answer).strip():
            continue
        votes.setdefault(str(answer).strip(), []).append(float(a))
    if not votes:
        return 0.0
    winner = max(votes.values(), key=len)  # max keeps the first of equal counts: insertion order
    return winner[0]


def maj_at_k(extras: Sequence, acc: Sequence[float] | np.ndarray, k: int, seed: int = 0) -> float:
    """Expected majority-vote accuracy of ``k`` of the ``n`` responses drawn without replacement.

    Every k-subset (kept in response order, so ties go to the answer stated first) when there are at
    most :data:`MAJ_EXACT_SUBSETS`; else the mean over that many subsets drawn uniformly with ``seed``.

    Args:
        extras: ``n`` per-response scorer extras (see :func:`majority_accuracy`).
        acc: ``(n,)`` the responses' accuracies.
        k: subset size, ``1 <= k <= n``.
        seed: seed of the drawn subsets (only used above the exact limit).

    Raises:
        ValueError: ``k`` outside ``[1, n]`` or ``extras`` and ``acc`` of different lengths.
    """
    n = len(acc)
    if len(extras) != n:
        raise ValueError(f"maj@k: {len(extras)} extras for {n} accuracies")
    _check(n, k)
    if math.comb(n, k) <= MAJ_EXACT_SUBSETS:
        subsets = itertools.combinations(range(n), k)
    else:
        rng = np.random.default_rng(seed)
        subsets = (sorted(rng.choice(n, size=k, replace=False)) for _ in range(MAJ_EXACT_SUBSETS))
    vals = [majority_accuracy([extras[i] for i in s], [acc[i] for i in s]) for s in subsets]
    return float(np.mean(vals))


def verl_ks(n: int) -> list[int]:
    """The k of verl's ``best@k`` / ``maj@k``: 2, 4, 8, ... below ``n``, then ``n`` (none for ``n < 2``)."""
    ks, k = [], 2
    while k < n:
        ks.append(k)
        k *= 2
    return ks + [n] if n >= 2 else []
