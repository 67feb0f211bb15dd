"""Unbiased pass@k, best@k and maj@k (stages/pass_at_k.py) against values worked out by hand and by
enumerating every k-subset."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from trajflow.stages.pass_at_k import MAJ_EXACT_SUBSETS, best_at_k, maj_at_k, majority_accuracy, pass_at_k, verl_ks


def test_pass_at_k_by_hand():
    # Chen et al. 2021, Eq. 1: 1 - C(n-c, k) / C(n, k)
    assert pass_at_k(4, 2, 1) == pytest.approx(2 / 4)
    assert pass_at_k(4, 2, 2) == pytest.approx(1 - 1 / 6)   # C(2,2)=1, C(4,2)=6
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)   # C(3,2)=3
    assert pass_at_k(4, 1, 3) == pytest.approx(1 - 1 / 4)   # C(3,3)=1, C(4,3)=4
    assert pass_at_k(4, 2, 3) == 1.0                        # n - c < k: every subset holds a correct one
    assert pass_at_k(5, 0, 5) == 0.0 and pass_at_k(5, 5, 1) == 1.0


@pytest.mark.parametrize("n,c", [(6, 2), (10, 3), (7, 0), (8, 8), (200, 17)])
def test_pass_at_k_matches_the_papers_stable_product_and_enumeration(n, c):
    for k in range(1, n + 1):
        # Chen et al.'s numerically stable form (their Figure 3): 1 - prod_{i=n-c+1}^{n} (1 - k / i)
        stable = 1.0 if n - c < k else 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))
        assert pass_at_k(n, c, k) == pytest.approx(stable, abs=1e-12)
    if n <= 10:  # the definition itself: the share of k-subsets holding a correct response
        correct = [1] * c + [0] * (n - c)
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(correct, k))
            assert pass_at_k(n, c, k) == pytest.approx(sum(max(s) for s in subsets) / len(subsets), abs=1e-12)


def test_best_at_k_by_hand_and_by_enumeration():
    # pairs of [0.2, 0.9, 0.5]: max 0.9, 0.5, 0.9 -> 2.3 / 3
    assert best_at_k([0.2, 0.9, 0.5], 2) == pytest.approx(2.3 / 3)
    assert best_at_k([0.2, 0.9, 0.5], 1) == pytest.approx(1.6 / 3)
    assert best_at_k([0.2, 0.9, 0.5], 3) == pytest.approx(0.9)
    assert best_at_k([float("nan"), 0.5], 2) == 0.5  # NaN counts as 0
    rng = np.random.default_rng(0)
    acc = rng.random(7)
    for k in range(1, 8):
        subsets = list(itertools.combinations(acc, k))
        assert best_at_k(acc, k) == pytest.approx(np.mean([max(s) for s in subsets]), abs=1e-12)
    # 0/1 accuracies: best@k is pass@k
    assert best_at_k([1, 0, 0, 1, 0], 3) == pytest.approx(pass_at_k(5, 2, 3))


def test_maj_at_k_by_hand():
    # "12"(1) "13"(0) none(0) "12"(1): pairs AB tie->"12" first 1, AC 1, AD 1, BC 0, BD tie->"13" 0, CD 1
    extras = [{"extracted": "12"}, {"extracted": "13"}, {}, {"extracted": " 12 "}]
    acc = [1.0, 0.0, 0.0, 1.0]
    assert maj_at_k(extras, acc, 2) == pytest.approx(4 / 6)
    assert maj_at_k(extras, acc, 4) == majority_accuracy(extras, acc) == 1.0
    assert maj_at_k(extras, acc, 1) == pytest.approx(2 / 4)  # a single voter's accuracy, 0 without an answer


def test_maj_at_k_draws_subsets_above_the_exact_limit():
    n, k = 16, 8
    assert math.comb(n, k) > MAJ_EXACT_SUBSETS
    # answers "a" (right) x9, "b" (wrong) x7: the subset's majority is right iff it holds >= 5 "a"
    # (ties of 4/4 go to whichever is stated first; response order a..a b..b puts "a" first)
    extras = [{"extracted": "a"}] * 9 + [{"extracted": "b"}] * 7
    acc = [1.0] * 9 + [0.0] * 7
    exact = sum(math.comb(9, j) * math.comb(7, k - j) for j in range(4, 9)) / math.comb(n, k)
    got = maj_at_k(extras, acc, k, seed=3)
    assert got == pytest.approx(exact, abs=0.03)
    assert maj_at_k(extras, acc, k, seed=3) == got  # deterministic


def test_verl_ks_and_errors():
    assert verl_ks(1) == [] and verl_ks(2) == [2] and verl_ks(4) == [2, 4]
    assert verl_ks(5) == [2, 4, 5] and verl_ks(8) == [2, 4, 8]
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(3, 1, 4)
    with pytest.raises(ValueError, match="0 <= c <= n"):
        pass_at_k(3, 4, 1)
