"""Advantage estimators: GAE, GRPO / Dr. GRPO, RLOO, REINFORCE++, ReMax, OPO, GPG, pass@k.

Every estimator is a pure function registered in :data:`ADV_ESTIMATORS` under its config name
(``algorithm.adv_estimator``) with one signature::

    fn(token_level_rewards, response_mask, index, config, *, values=None, reward_baselines=None)
        -> (advantages, returns)

Shapes and dtypes:
    token_level_rewards: ``(batch, response_len)`` float; the reward of each response token (for
        outcome rewards, the score sits on the last valid token and the rest are 0).
    response_mask: ``(batch, response_len)`` bool or 0/1 float/int; 1 on tokens the policy
        generated. Gaps (0s in the middle, e.g. tool/observation tokens of a multi-turn rollout)
        and rows without EOS (all ones) are both valid.
    index: length-``batch`` sequence of group ids (``str`` or ``int``, e.g. the prompt uid): rows
        with the same id are samples for the same prompt.
    advantages, returns: ``(batch, response_len)`` float32, exactly 0 outside the mask.

Guarantees, for every valid input (finite rewards on masked tokens):
    * no NaN/inf in the outputs; anything stored outside the mask (garbage after EOS, even NaN)
      never reaches the outputs;
    * group statistics are computed in float64, and a group whose scores are all equal (including
      a group of one) gets an advantage of exactly ``0.0`` from every group-baseline estimator;
    * outcome-level advantages are broadcast to every valid token of the row.

Inputs are validated at this boundary; errors name the argument, the row and what was expected.

The package: :mod:`~trajflow.stages.advantage.registry` (the registry, :class:`AdvantageConfig`,
:func:`masked_whiten`), :mod:`~trajflow.stages.advantage.token_level` (GAE, REINFORCE++, ReMax, OPD),
:mod:`~trajflow.stages.advantage.outcome` (GRPO, RLOO, REINFORCE++ baseline, OPO, GPG, pass@k),
:mod:`~trajflow.stages.advantage.table` (:func:`compute_advantage`, :func:`advantage_table`). Importing this
package registers every estimator.
"""

from __future__ import annotations

from trajflow.stages.advantage.outcome import (compute_gpg_outcome_advantage, compute_grpo_outcome_advantage,
                                      compute_grpo_passk_outcome_advantage, compute_opo_outcome_advantage,
                                      compute_reinforce_plus_plus_baseline_advantage,
                                      compute_rloo_outcome_advantage)
from trajflow.stages.advantage.registry import ADV_ESTIMATORS, WHITEN_EPS, AdvantageConfig, EstimatorMeta, masked_whiten
from trajflow.stages.advantage.token_level import (compute_gae_advantage_return, compute_opd_advantage,
                                          compute_reinforce_plus_plus_advantage, compute_remax_advantage)
from trajflow.stages.advantage.table import advantage_table, compute_advantage, fill_dropped_rows

__all__ = [
    "ADV_ESTIMATORS",
    "AdvantageConfig",
    "EstimatorMeta",
    "WHITEN_EPS",
    "advantage_table",
    "compute_advantage",
    "compute_gae_advantage_return",
    "compute_grpo_outcome_advantage",
    "compute_rloo_outcome_advantage",
    "compute_reinforce_plus_plus_advantage",
    "compute_reinforce_plus_plus_baseline_advantage",
    "compute_remax_advantage",
    "compute_opo_outcome_advantage",
    "compute_gpg_outcome_advantage",
    "compute_grpo_passk_outcome_advantage",
    "compute_opd_advantage",
    "masked_whiten",
    "needs_greedy_baseline",
    "needs_groups",
    "needs_values",
    "fill_dropped_rows",
]


def needs_values(name: str) -> bool:
    """Whether the estimator registered as ``name`` needs a critic's values.

    Raises:
        ValueError: unknown ``name`` (lists the registered ones).
    """
    return ADV_ESTIMATORS.meta(name).needs_values


def needs_groups(name: str) -> bool:
    """Whether estimator ``name`` needs several samples per prompt (:attr:`EstimatorMeta.needs_groups`).

    Raises:
        ValueError: unknown estimator (lists the registered ones).
    """
    return ADV_ESTIMATORS.meta(name).needs_groups


def needs_greedy_baseline(name: str) -> bool:
    """Whether the estimator registered as ``name`` needs a greedy-rollout baseline reward per prompt.

    Raises:
        ValueError: unknown ``name`` (lists the registered ones).
    """
    return ADV_ESTIMATORS.meta(name).needs_greedy_baseline
