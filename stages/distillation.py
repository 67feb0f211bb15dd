"""On-policy distillation (OPD): the student samples, a teacher scores the sampled tokens.

Generalized Knowledge Distillation (Agarwal et al. 2024, "On-Policy Distillation of Language Models:
Learning from Self-Generated Mistakes", ICLR, Sec. 3) trains the student on its own samples against
a teacher's token distributions; with the reverse KL as the divergence (their Eq. 4 with
``D = KL(student || teacher)``) the objective is ``min E_{y ~ student} sum_t KL(p_S(.|y<t) || p_T(.|y<t))``.
Thinking Machines' "On-Policy Distillation" (Lu et al. 2025) estimates that reverse KL on the sampled
token alone and trains with it as a per-token reward of an RL loop, with discount 0 (each token is
credited only its own term):

    A_t = lambda * (log p_T(y_t | y<t) - log p_S(y_t | y<t))

so a token the teacher finds likelier than the student does is pushed up, one it finds less likely
pushed down; the sum over the response is minus the single-sample estimate of
``KL(p_S || p_T)`` of the response (``E_{y ~ p_S}[log p_S(y) - log p_T(y)]``, the k1 estimator).

``algorithm.adv_estimator=opd`` uses it as the advantage; ``algorithm.opd_task_coef = mu > 0`` adds
``mu`` times the task reward's GRPO advantage (Shao et al. 2024) to every token, mixing distillation
with the task reward. ``log p_S`` is the student's log-prob of the token when it was sampled (the
rollout's behaviour log-probs), ``log p_T`` the teacher's at the same temperature.

Plain tensor functions; no Ray, no Prefect.
"""

from __future__ import annotations

import torch

__all__ = ["opd_advantage", "reverse_kl_metrics"]


def _check(teacher_log_probs: torch.Tensor, student_log_probs: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    if teacher_log_probs.dim() != 2:
        raise ValueError(f"teacher_log_probs must be (batch, response_len), got {tuple(teacher_log_probs.shape)}")
    for name, t in (("student_log_probs", student_log_probs), ("response_mask", response_mask)):
        if t.shape != teacher_log_probs.shape:
            raise ValueError(f"{name} must have the shape of teacher_log_probs {tuple(teacher_log_probs.shape)}, "
                             f"got {tuple(t.shape)}")
    return response_mask if response_mask.dtype == torch.bool else response_mask != 0


@torch.no_grad()
def opd_advantage(
    teacher_log_probs: torch.Tensor,
    student_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    coef: float = 1.0,
    task_advantages: torch.Tensor | None = None,
    task_coef: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token on-policy distillation advantage (Lu et al. 2025; Agarwal et al. 2024, reverse KL).

    ``A_t = coef * (teacher_t - student_t) + task_coef * task_advantages_t`` on valid tokens, 0 elsewhere;
    the return equals the advantage (discount 0: no value function, no bootstrapping).

    Args:
        teacher_log_probs: ``(batch, response_len)`` float, the teacher's log-probs of the sampled tokens.
        student_log_probs: ``(batch, response_len)`` float, the student's (behaviour) log-probs of them.
        response_mask: ``(batch, response_len)`` bool or 0/1, the tokens the student generated.
        coef: ``lambda >= 0``, the weight of the reverse-KL term (``algorithm.opd_coef``).
        task_advantages: optional ``(batch, response_len)`` advantage of the task reward (e.g. GRPO's).
        task_coef: ``mu >= 0``, its weight (``algorithm.opd_task_coef``).

    Returns:
        ``(advantages, returns)``, float32 ``(batch, response_len)``, the same tensor twice.

    Raises:
        ValueError: mismatched shapes, a negative coefficient, or ``task_coef > 0`` without
            ``task_advantages``.
    """
    mask = _check(teacher_log_probs, student_log_probs, response_mask)
    if coef < 0 or task_coef < 0:
        raise ValueError(f"algorithm.opd_coef and algorithm.opd_task_coef must be >= 0, got {coef}, {task_coef}")
    diff = teacher_log_probs.double() - student_log_probs.double()
    adv = coef * torch.where(mask, diff, torch.zeros_like(diff))
    if task_coef:
        if task_advantages is None or task_advantages.shape != diff.shape:
            raise ValueError("algorithm.opd_task_coef > 0 needs the task advantages, shaped like the log-probs")
        adv = adv + task_coef * torch.where(mask, task_advantages.double(), torch.zeros_like(diff))
    adv = adv.to(torch.float32)
    return adv, adv.clone()


@torch.no_grad()
def reverse_kl_metrics(teacher_log_probs: torch.Tensor, student_log_probs: torch.Tensor,
                       response_mask: torch.Tensor) -> dict[str, float]:
    """How far the student is from the teacher on its own samples.

    With ``d_t = student_t - teacher_t`` on valid tokens and ``n_i`` valid tokens in row i:

    - ``distill/reverse_kl``: token mean of ``d_t`` (k1 estimate of KL(student || teacher) per token);
    - ``distill/reverse_kl_seq``: row mean of ``sum_t d_t`` (the same per response);
    - ``distill/teacher_logprob`` / ``distill/student_logprob``: token means of each log-prob.

    Args:
        teacher_log_probs, student_log_probs: ``(batch, response_len)`` float.
        response_mask: ``(batch, response_len)`` bool or 0/1.

    Returns:
        The metrics as floats (0 when no token is valid), computed in float64.
    """
    mask = _check(teacher_log_probs, student_log_probs, response_mask)
    n = int(mask.sum())
    if n == 0:
        return {k: 0.0 for k in ("distill/reverse_kl", "distill/reverse_kl_seq", "distill/teacher_logprob",
                                 "distill/student_logprob")}
    t, s = teacher_log_probs.double(), student_log_probs.double()
    d = torch.where(mask, s - t, torch.zeros_like(t))
    rows = mask.any(dim=-1)
    return {
        "distill/reverse_kl": float(d.sum() / n),
        "distill/reverse_kl_seq": float(d.sum(dim=-1)[rows].mean()),
        "distill/teacher_logprob": float(t[mask].mean()),
        "distill/student_logprob": float(s[mask].mean()),
    }
