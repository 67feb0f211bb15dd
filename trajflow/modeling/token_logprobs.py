"""Log-probs and entropy of the response tokens from the LM head's logits, in few passes.

The vocabulary axis is the widest tensor of a policy update; :class:`LogProbEntropy` computes both
quantities from one shifted copy and one softmax, saves only the softmax for the backward, and
writes the gradient in one pass (its docstring has the formulas).
"""

from __future__ import annotations

import torch

#: Rows whose float32 softmax is computed at once. The float32 pass over a whole chunk of logits
#: (rows x vocab x 4 bytes: 197 MB for 1000 response positions of SmolLM2's 49k vocabulary) was
#: allocated at the start of the update's backward, while every activation was still held, and set
#: the policy worker's peak; blocks of 256 rows keep it to 48 MB. Every operation here is row-wise,
#: so the values do not depend on the block size.
ROW_BLOCK = 256


def _row_blocks(n: int):
    """Slices of ``ROW_BLOCK`` consecutive rows covering ``0 .. n - 1``."""
    return (slice(a, min(n, a + ROW_BLOCK)) for a in range(0, n, ROW_BLOCK))


def _shifted(logits: torch.Tensor, inv_t: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """``z = (x - max x) / tau`` in float32, a new tensor (or written into ``out``).

    One pass over bf16 logits: their maximum is taken in their own dtype (widening is exact and keeps
    the order, so it is the float32 maximum) and the subtraction widens each element as it reads it;
    the same values as casting the whole chunk to float32 first, without the two float32 copies.
    """
    z = torch.sub(logits.detach(), logits.detach().amax(dim=-1, keepdim=True).float(), out=out)
    if inv_t != 1.0:
        z.mul_(inv_t)
    return z


def _softmax(logits: torch.Tensor, inv_t: float) -> torch.Tensor:
    """``softmax(logits / tau)`` in float32 by the forward's own operations (so the same values)."""
    p = torch.exp(_shifted(logits, inv_t))
    return p.div_(p.sum(dim=-1)[:, None])


class LogProbEntropy(torch.autograd.Function):
    """``(log p_y, H)`` per row of ``(n, vocab)`` logits.

    SmolLM2's 49k vocabulary columns times ~600 response positions are 122 MB of float32 per pass.
    Composing ``gather``, ``logsumexp`` and a second ``logsumexp``/``softmax`` for the entropy, as
    autograd sees them, costs ~35 passes over it between forward and backward (~0.27 s of a 2.5 s
    update on 2 CPU cores); this function needs ~8. Logits in a narrower dtype than float32 (bf16
    under autocast) are saved instead of the float32 softmax, which the backward recomputes with
    the forward's operations: half the bytes for one more pass. The float32 work runs
    :data:`ROW_BLOCK` rows at a time, forward and backward.

    Formulas (``z = (x - max x) / tau`` for raw logits ``x`` and temperature ``tau``;
    ``s = sum_j e^{z_j}``; ``p = softmax(x / tau) = e^z / s``):

    - log-prob of label ``y``: ``log p_y = z_y - log s``;
    - entropy: ``H = -sum_j p_j log p_j = log s - sum_j p_j z_j``;
    - gradients (softmax cross-entropy, e.g. Goodfellow et al. 2016, Deep Learning, Sec. 6.2.2.3):
      ``d log p_y / d x_k = (1[k = y] - p_k) / tau`` and
      ``d H / d x_k = -p_k (log p_k + H) / tau``.

    ``apply(logits, labels, temperature, entropy_grad, compute_entropy, for_backward)``:

    Args:
        logits: ``(n, vocab)`` float32 raw logits (not divided by the temperature).
        labels: ``(n,)`` int64 token ids.
        temperature: ``tau > 0`` of ``softmax(logits / tau)``.
        entropy_grad: whether the entropy is differentiable (an entropy bonus); otherwise it is a
            metric and gets no gradient (nothing extra is saved for it).
        compute_entropy: ``False`` skips the entropy (its pass over the logits): it is then ``None``.
        for_backward: whether a backward can follow (grad mode on, logits requiring grad); without
            it the softmax is neither normalised nor saved.

    Returns:
        ``(log_probs, entropy)``, ``(n,)`` float32 each (``entropy`` ``None`` without ``compute_entropy``).
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, temperature: float, entropy_grad: bool,
                compute_entropy: bool = True, for_backward: bool = True):
        inv_t = 1.0 / float(temperature)
        n, vocab = logits.shape
        entropy_grad = bool(entropy_grad and compute_entropy)
        # Logits narrower than float32 (a bf16 autocast's) are half the bytes of the float32
        # softmax: keep them and recompute the softmax in the backward, with the same operations.
        recompute = for_backward and logits.element_size() < 4 and not entropy_grad
        keep_p = for_backward and not recompute
        logp = torch.empty(n, dtype=torch.float32, device=logits.device)
        entropy = torch.empty_like(logp) if compute_entropy else None
        f32 = dict(dtype=torch.float32, device=logits.device)
        p_all = torch.empty(n, vocab, **f32) if keep_p else None
        z_all = torch.empty(n, vocab, **f32) if keep_p and entropy_grad else None
        log_s_all = torch.empty(n, **f32) if keep_p and entropy_grad else None
        for r in _row_blocks(n):  # every operation is row-wise: blocks give the same values
            z = _shifted(logits[r], inv_t, out=z_all[r] if z_all is not None else None)
            z_y = z.gather(-1, labels[r, None]).squeeze(-1)
            p = torch.exp(z, out=p_all[r]) if keep_p else torch.exp(z)
            s_ = p.sum(dim=-1)
            log_s = s_.log()
            torch.sub(z_y, log_s, out=logp[r])
            if compute_entropy:
                # sum_j e^{z_j} z_j; z is only needed again for the entropy's own gradient.
                pz = (p * z).sum(dim=-1) if entropy_grad else z.mul_(p).sum(dim=-1)
                torch.sub(log_s, pz / s_, out=entropy[r])
            if keep_p:
                p.div_(s_[:, None])
                if entropy_grad:  # z was written into z_all
                    log_s_all[r] = log_s
        if not for_backward:
            return logp, entropy
        ctx.inv_t = inv_t
        ctx.logits_dtype = logits.dtype
        ctx.entropy_grad = entropy_grad
        ctx.used = False
        ctx.recompute = recompute
        if recompute:
            ctx.save_for_backward(logits, labels)
        else:
            ctx.save_for_backward(p_all, labels, *((z_all, log_s_all, entropy) if entropy_grad else ()))
        if entropy is not None and not ctx.entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, g_logp: torch.Tensor, g_entropy: torch.Tensor | None):
        if ctx.used:
            raise RuntimeError("LogProbEntropy's backward reuses its saved softmax and runs once; "
                               "retain_graph=True backward passes through it are not supported")
        ctx.used = True
        saved, labels = ctx.saved_tensors[:2]
        if ctx.recompute:  # saved: the logits; the softmax comes back one block of rows at a time
            if g_logp is None:
                return None, None, None, None, None, None
            grad = torch.empty_like(saved)
            g = g_logp * ctx.inv_t
            for r in _row_blocks(saved.shape[0]):
                gb = _softmax(saved[r], ctx.inv_t).mul_((-g[r])[:, None])
                gb.scatter_add_(-1, labels[r, None], g[r, None])
                grad[r] = gb
            return grad, None, None, None, None, None
        p = saved  # the softmax
        g_h = None
        if ctx.entropy_grad and g_entropy is not None:
            _, _, z, log_s, entropy = ctx.saved_tensors
            # -p_k (log p_k + H) with log p_k = z_k - log s.
            g_h = z.sub_((log_s - entropy)[:, None]).mul_(p).mul_((-g_entropy * ctx.inv_t)[:, None])
        grad = g_h
        if g_logp is not None:
            g = g_logp * ctx.inv_t
            # The softmax is not needed after this: the gradient is written over it.
            grad = p.mul_((-g)[:, None])
            grad.scatter_add_(-1, labels[:, None], g[:, None])
            if g_h is not None:
                grad.add_(g_h)
        if grad is not None and grad.dtype != ctx.logits_dtype:
            grad = grad.to(ctx.logits_dtype)
        return grad, None, None, None, None, None


def token_logprobs_entropy(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0,
                           entropy_grad: bool = False,
                           compute_entropy: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of ``labels`` and entropy under ``softmax(logits / temperature)``, row by row.

    Args:
        logits: ``(n, vocab)`` float (cast to float32).
        labels: ``(n,)`` int64, each in ``[0, vocab)``.
        temperature: > 0; must be the sampling temperature for the PPO ratio to start at 1.
        entropy_grad: see :class:`LogProbEntropy`.
        compute_entropy: ``False`` skips the entropy (returned as ``None``): log-prob-only callers
            (old and reference log-probs) save a pass over the logits.

    Returns:
        ``(log_probs, entropy)``, ``(n,)`` float32 each (``entropy`` ``None`` without ``compute_entropy``).

    Raises:
        ValueError: ``temperature <= 0``, or ``logits``/``labels`` shapes that do not match.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for log-probs, got {temperature}")
    if logits.dim() != 2 or labels.shape != logits.shape[:1]:
        raise ValueError(f"expected logits (n, vocab) and labels (n,), got {tuple(logits.shape)} and "
                         f"{tuple(labels.shape)}")
    for_backward = torch.is_grad_enabled() and logits.requires_grad
    return LogProbEntropy.apply(logits, labels, float(temperature), bool(entropy_grad), bool(compute_entropy),
                                for_backward)
