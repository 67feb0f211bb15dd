"""KL divergence estimators, KL-in-reward shaping and the KL coefficient controllers.

Per-token estimators of KL(pi || pi_ref) from the log-probabilities of the sampled tokens
(J. Schulman, "Approximating KL divergence", 2020, http://joschu.net/blog/kl-approx.html), with
the log-ratio ``log_ratio = logprob - ref_logprob = log pi(x) - log pi_ref(x)``:

============  ==============================================  =========================
name          value per token                                 aliases
============  ==============================================  =========================
``k1``        ``log_ratio``                                   ``kl``
``abs``       ``|log_ratio|``
``k2``        ``0.5 * log_ratio**2``                          ``mse``
``k3``        ``exp(-log_ratio) - (-log_ratio) - 1``,         ``low_var_kl``
              clamped to [-10, 10]
============  ==============================================  =========================

Every name also exists with a ``+`` suffix (``k1+``, ``k3+``, ``low_var_kl+``, ...): a
straight-through estimator whose *value* is the named estimator's and whose *gradient* is k2's
(``k2 - k2.detach() + value.detach()``), because the gradient of k2 is the unbiased estimate of
the gradient of the KL while k1/k3 are unbiased (or low-variance) estimates of its value only
(verl's ``+`` convention).

As a loss term, only estimators with k2's gradient (``k2``/``mse`` and every ``+`` name) have
the expected gradient of KL(pi || pi_ref) when the tokens are sampled from pi: k3's expected
gradient is ``pi - pi_ref`` per logit, not the KL's. :data:`DEFAULT_KL_LOSS_TYPE` is therefore
``low_var_kl+`` (verl's default ``actor.kl_loss_type`` is ``low_var_kl``). When the tokens were
sampled from an older policy, the k2 gradient needs the importance ratio pi / pi_old
(:func:`has_k2_gradient`, :func:`trajflow.stages.policy_update.kl_loss`).
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any

import torch

from trajflow.stages.registry import Registry

__all__ = [
    "DEFAULT_KL_LOSS_TYPE",
    "KL_ESTIMATORS",
    "has_k2_gradient",
    "kl_penalty",
    "FixedKLController",
    "AdaptiveKLController",
    "make_kl_controller",
    "apply_kl_penalty_to_rewards",
]

KL_ESTIMATORS = Registry("KL estimator")

#: k3 clamps the reference/policy log-ratio before exp() (overflow guard) ...
K3_LOG_RATIO_CLAMP = 20.0
#: ... and its value to [-10, 10] (verl's bounds); outside the bound the gradient is 0.
K3_VALUE_CLAMP = 10.0


@KL_ESTIMATORS.register("k1")
@KL_ESTIMATORS.register("kl")
def kl_k1(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    """k1 = log pi(x) - log pi_ref(x); unbiased for KL(pi || pi_ref), high variance, can be < 0.

    Args:
        logprob, ref_logprob: ``(batch, response_len)`` float log-probabilities of the sampled
            tokens under the policy and the reference.

    Returns:
        ``(batch, response_len)`` per-token estimate.
    """
    return logprob - ref_logprob


@KL_ESTIMATORS.register("abs")
def kl_abs(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    """|log pi(x) - log pi_ref(x)| per token; shapes as :func:`kl_k1`."""
    return (logprob - ref_logprob).abs()


@KL_ESTIMATORS.register("k2")
@KL_ESTIMATORS.register("mse")
def kl_k2(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    """k2 = 0.5 * (log pi(x) - log pi_ref(x))^2 (Schulman 2020): biased, low variance, >= 0.

    Its gradient, (log pi - log pi_ref) * grad log pi, is an unbiased estimate of grad KL.
    Shapes as :func:`kl_k1`.
    """
    return 0.5 * (logprob - ref_logprob).square()


@KL_ESTIMATORS.register("k3")
@KL_ESTIMATORS.register("low_var_kl")
def kl_k3(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
    """k3 = (r - 1) - log r with r = pi_ref(x) / pi(x) (Schulman 2020): unbiased, low variance, >= 0.

    Computed as ``exp(d) - d - 1`` with ``d = ref_logprob - logprob`` clamped to [-20, 20] before
    the exp, and the result clamped to [-10, 10] (verl's bounds); where a clamp is active the
    gradient is 0. Shapes as :func:`kl_k1`.
    """
    d = torch.clamp(ref_logprob - logprob, min=-K3_LOG_RATIO_CLAMP, max=K3_LOG_RATIO_CLAMP)
    return torch.clamp(torch.exp(d) - d - 1.0, min=-K3_VALUE_CLAMP, max=K3_VALUE_CLAMP)


def _straight_through(value_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Callable[..., torch.Tensor]:
    def estimator(logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
        value = value_fn(logprob, ref_logprob)
        surrogate = kl_k2(logprob, ref_logprob)
        return surrogate - surrogate.detach() + value.detach()

    estimator.__name__ = f"{value_fn.__name__}_straight_through"
    estimator.__qualname__ = estimator.__name__
    estimator.__doc__ = (
        f"Straight-through KL: the value of ``{value_fn.__name__}``, the gradient of k2 "
        "(``k2 - k2.detach() + value.detach()``). Shapes as :func:`kl_k1`."
    )
    return estimator


for _name in ("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl"):
    KL_ESTIMATORS.register(f"{_name}+")(_straight_through(KL_ESTIMATORS.get(_name)))
del _name


#: The default KL-loss estimator (``actor.kl_loss_type``): k3's value, k2's (unbiased) gradient.
DEFAULT_KL_LOSS_TYPE = "low_var_kl+"


def has_k2_gradient(kl_type: str) -> bool:
    """Whether the estimator's gradient is k2's, ``(log pi - log pi_ref) * grad log pi``.

    Those are the estimators whose loss gradient is unbiased for grad KL(pi || pi_ref) on samples
    from pi, and so the ones that an importance ratio pi / pi_old makes unbiased on samples from
    pi_old.

    Args:
        kl_type: a name in ``KL_ESTIMATORS.names()``.

    Returns:
        True for ``k2``/``mse`` and every ``+`` name.

    Raises:
        ValueError: unknown ``kl_type`` (lists the registered names).
    """
    KL_ESTIMATORS.get(kl_type)
    return kl_type in ("k2", "mse") or kl_type.endswith("+")


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_type: str) -> torch.Tensor:
    """Per-token KL estimate between the policy and the reference (no masking, no reduction).

    Args:
        logprob: ``(batch, response_len)`` float, log pi(x_t) of the sampled tokens.
        ref_logprob: ``(batch, response_len)`` float, log pi_ref(x_t).
        kl_type: a name in ``KL_ESTIMATORS.names()`` (``k1``/``kl``, ``abs``, ``k2``/``mse``,
            ``k3``/``low_var_kl``, each also with a ``+`` straight-through suffix).

    Returns:
        ``(batch, response_len)`` tensor in the dtype of the inputs; differentiable.

    Raises:
        ValueError: unknown ``kl_type`` (lists the registered names), or mismatched shapes.
    """
    fn = KL_ESTIMATORS.get(kl_type)
    if logprob.shape != ref_logprob.shape:
        raise ValueError(
            f"logprob and ref_logprob must have the same shape, got {tuple(logprob.shape)} and {tuple(ref_logprob.shape)}"
        )
    return fn(logprob, ref_logprob)


# --------------------------------------------------------------------------------------------
# KL coefficient controllers (KL-in-reward)
# --------------------------------------------------------------------------------------------


class FixedKLController:
    """A constant KL coefficient.

    Args:
        kl_coef: the coefficient beta, >= 0.

    Attributes:
        value: the current coefficient.
    """

    def __init__(self, kl_coef: float) -> None:
        if isinstance(kl_coef, bool) or not isinstance(kl_coef, numbers.Real) or not kl_coef >= 0:
            raise ValueError(f"kl_ctrl.kl_coef must be a number >= 0, got {kl_coef!r}")
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op (kept for the controller interface)."""

    def state_dict(self) -> dict[str, Any]:
        """``{"type": "fixed", "value": beta}`` for checkpoints."""
        return {"type": "fixed", "value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``value`` from :meth:`state_dict`'s output.

        Raises:
            ValueError: ``state`` lacks a numeric ``value``.
        """
        self.value = _state_value(state)


class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al. 2019, arXiv:1909.08593, sec. 2.2, eq. 2).

    e_t = clip(KL_t / KL_target - 1, -0.2, 0.2);  beta_{t+1} = beta_t * (1 + K_beta * e_t) with
    K_beta = n_steps / horizon.

    Args:
        init_kl_coef: the starting beta, >= 0.
        target_kl: the KL the controller steers towards, > 0.
        horizon: the number of steps over which the coefficient may change by about e, > 0.

    Attributes:
        value: the current coefficient.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int | float) -> None:
        for key, val, lower_ok in (("kl_coef", init_kl_coef, True), ("target_kl", target_kl, False), ("horizon", horizon, False)):
            if isinstance(val, bool) or not isinstance(val, numbers.Real) or not (val >= 0 if lower_ok else val > 0):
                raise ValueError(f"kl_ctrl.{key} must be a number {'>= 0' if lower_ok else '> 0'} for the adaptive controller, got {val!r}")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Move ``value`` towards the target after observing ``current_kl`` over ``n_steps`` samples.

        Args:
            current_kl: the measured KL (same estimator and units as ``target_kl``).
            n_steps: the number of steps (verl: the batch size) the measurement covers.
        """
        error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, Any]:
        """``{"type": "adaptive", "value", "target", "horizon"}`` for checkpoints."""
        return {"type": "adaptive", "value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``value`` (and ``target``/``horizon`` when present) from :meth:`state_dict`.

        Raises:
            ValueError: ``state`` lacks a numeric ``value``.
        """
        self.value = _state_value(state)
        if "target" in state:
            self.target = float(state["target"])
        if "horizon" in state:
            self.horizon = float(state["horizon"])


def _state_value(state: Any) -> float:
    if not isinstance(state, dict) or isinstance(state.get("value"), bool) or not isinstance(state.get("value"), numbers.Real):
        raise ValueError(f"KL controller state must be a dict with a numeric 'value', got {state!r}")
    return float(state["value"])


def make_kl_controller(
    type: str, kl_coef: float, target_kl: float | None = None, horizon: int | float | None = None
) -> FixedKLController | AdaptiveKLController:
    """Build the KL controller named in config (``algorithm.kl_ctrl.type``).

    Args:
        type: ``"fixed"`` or ``"adaptive"``.
        kl_coef: the (initial) coefficient.
        target_kl: adaptive only, > 0.
        horizon: adaptive only, > 0.

    Returns:
        A :class:`FixedKLController` or :class:`AdaptiveKLController`.

    Raises:
        ValueError: unknown ``type``, or invalid numbers (named by their config key).
    """
    if type == "fixed":
        return FixedKLController(kl_coef)
    if type == "adaptive":
        return AdaptiveKLController(kl_coef, target_kl, horizon)  # type: ignore[arg-type]
    raise ValueError(f"Unknown kl_ctrl.type {type!r}; expected one of ['adaptive', 'fixed']")


@torch.no_grad()
def apply_kl_penalty_to_rewards(
    token_level_scores: torch.Tensor,
    logprob: torch.Tensor,
    ref_logprob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_coef: float,
    kl_type: str,
) -> tuple[torch.Tensor, float]:
    """KL-in-reward shaping: r_t = score_t - beta * KL_t (Ziegler et al. 2019, eq. 1; Ouyang et al. 2022, eq. 2).

    Args:
        token_level_scores: ``(batch, response_len)`` float, the reward per token before shaping.
        logprob: ``(batch, response_len)`` float, the rollout policy's log-probs of the tokens.
        ref_logprob: ``(batch, response_len)`` float, the reference model's.
        response_mask: ``(batch, response_len)`` bool or 0/1.
        kl_coef: beta (e.g. the controller's ``value``).
        kl_type: a KL estimator name (see :func:`kl_penalty`).

    Returns:
        ``(token_level_rewards, mean_kl)``: rewards ``(batch, response_len)`` in the dtype of the
        scores, 0 outside the mask, no gradient; ``mean_kl`` is the batch mean of each row's
        token-mean KL (verl's ``actor/reward_kl_penalty``), over rows with at least one valid
        token (0.0 when there is none), to feed the controller's ``update``.

    Raises:
        ValueError: mismatched shapes or an unknown ``kl_type``.
    """
    shape = token_level_scores.shape
    for name, t in (("logprob", logprob), ("ref_logprob", ref_logprob), ("response_mask", response_mask)):
        if t.shape != shape:
            raise ValueError(f"{name} must have the shape of token_level_scores {tuple(shape)}, got {tuple(t.shape)}")
    mask = response_mask if response_mask.dtype == torch.bool else response_mask != 0
    kl = kl_penalty(logprob.detach().float(), ref_logprob.detach().float(), kl_type)
    kl = torch.where(mask, kl, torch.zeros_like(kl))
    rewards = token_level_scores - kl_coef * kl.to(token_level_scores.dtype)
    rewards = torch.where(mask, rewards, torch.zeros_like(rewards))
    lengths = mask.sum(dim=-1)
    has_tokens = lengths > 0
    if bool(has_tokens.any()):
        per_row = kl.sum(dim=-1)[has_tokens] / lengths[has_tokens]
        mean_kl = float(per_row.mean())
    else:
        mean_kl = 0.0
    return rewards, mean_kl
