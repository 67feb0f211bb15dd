"""Requests from many episodes at once, batched into the rollout engine's ``generate`` calls.

HTTP handlers (any thread) :meth:`GenerationQueue.submit` a prompt and wait on a future; the
engine's own thread runs :meth:`GenerationQueue.serve`, which takes every pending request once
either each live episode has one waiting or a short window has passed since the first, and feeds
them to the engine together (its continuous batching then keeps the decode slots full). Requests
with the same sampling settings share one ``generate`` call, sampled to the largest ``max_tokens``
among them; each row is then cut to its own request's ``max_tokens`` (a sample of the capped
length: the tokens before the cap do not depend on those after it).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Sequence

from trajflow.stages.rollout import SamplingParams


@dataclass(frozen=True)
class Sampled:
    """One sampled row of a request.

    Attributes:
        ids: the sampled ids (EOS included when the model stopped), at most the request's ``max_new_tokens``.
        logprobs: the engine's log-prob per id, or None (greedy).
        finish_reason: ``stop`` (EOS) or ``length``.
        top: with ``top_logprobs`` asked: per id, the ``k`` most likely ``(id, log-prob)`` at its position.
    """

    ids: list[int]
    logprobs: list[float] | None
    finish_reason: str
    top: list[list[tuple[int, float]]] | None = None


@dataclass
class _Request:
    prompt_ids: list[int]
    n: int
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    top_logprobs: int = 0
    future: Future = field(default_factory=Future)


class GenerationQueue:
    """Batches requests into ``generate(prompt_ids, params)`` calls made from one thread.

    Args:
        generate: the engine's ``generate`` (:meth:`trajflow.engines.base.RolloutEngine.generate`).
        seed: the base seed; call k is sampled with a seed derived from it and k.
        window_s: how long the first pending request waits for others before the batch runs.
        top_logprobs: ``(prompt_ids, response_ids per row, k, temperature) -> per row, per token, the
            k most likely (id, log-prob)`` (:func:`trajflow.serve.top_logprobs.teacher_forced_top_logprobs`),
            called from the engine's thread after sampling; None: requests for them are refused.
    """

    def __init__(self, generate: Callable, seed: int = 0, window_s: float = 0.05,
                 top_logprobs: Callable | None = None) -> None:
        self.generate = generate
        self.top_logprobs = top_logprobs
        self.seed = int(seed)
        self.window_s = float(window_s)
        self._pending: list[_Request] = []
        self._cond = threading.Condition()
        self.engine_calls = 0
        self.requests = 0
        self.rows = 0

    def submit(self, prompt_ids: Sequence[int], n: int, max_new_tokens: int, temperature: float,
               top_p: float = 1.0, top_k: int = 0, top_logprobs: int = 0) -> Future:
        """Queue one prompt for ``n`` samples (with the ``top_logprobs`` most likely tokens at each
        position when > 0); the future's result is a list of ``n`` :class:`Sampled`."""
        req = _Request([int(t) for t in prompt_ids], int(n), int(max_new_tokens), float(temperature), float(top_p),
                       int(top_k), int(top_logprobs))
        with self._cond:
            self._pending.append(req)
            self._cond.notify_all()
        return req.future

    def serve(self, done: Callable[[], bool], live: Callable[[], int]) -> None:
        """Run the engine on the queued requests until ``done()`` and nothing is pending.

        Args:
            done: whether every episode has ended.
            live: how many episodes are running (a batch runs at once when that many requests wait).

        Raises:
            Exception: whatever the engine raised (the requests of that batch get it too).
        """
        while True:
            with self._cond:
                while not self._pending:
                    if done():
                        return
                    self._cond.wait(0.02)
                first = time.monotonic()
                while len(self._pending) < max(1, live()):
                    left = self.window_s - (time.monotonic() - first)
                    if left <= 0:
                        break
                    self._cond.wait(left)
                batch, self._pending = self._pending, []
            self._run(batch)

    def _run(self, batch: list[_Request]) -> None:
        groups: dict[tuple, list[_Request]] = {}
        for r in batch:
            groups.setdefault((r.temperature, r.top_p, r.top_k), []).append(r)
        for (temperature, top_p, top_k), reqs in groups.items():
            prompts = [r.prompt_ids for r in reqs for _ in range(r.n)]
            params = SamplingParams(n=1, temperature=temperature, top_p=top_p, top_k=top_k,
                                    max_new_tokens=max(r.max_new_tokens for r in reqs),
                                    seed=(self.seed * 1_000_003 + self.engine_calls * 7_919) % (2 ** 62))
            try:
                out = self.generate(prompts, params)
            except BaseException as e:
                for r in reqs:
                    r.future.set_exception(e)
                raise
            self.engine_calls += 1
            self.requests += len(reqs)
            self.rows += len(prompts)
            row = 0
            for r in reqs:
                got = []
                for _ in range(r.n):
                    ids = list(out.response_ids[row])
                    lps = list(out.rollout_logprobs[row]) if out.rollout_logprobs is not None else None
                    finish = out.finish_reason[row]
                    if len(ids) > r.max_new_tokens:
                        ids, finish = ids[:r.max_new_tokens], "length"
                        lps = lps[:r.max_new_tokens] if lps is not None else None
                    got.append(Sampled(ids, lps, finish))
                    row += 1
                if r.top_logprobs > 0 and self.top_logprobs is not None:
                    try:
                        tops = self.top_logprobs(r.prompt_ids, [g.ids for g in got], r.top_logprobs, r.temperature)
                    except Exception as e:  # noqa: BLE001 - this request's failure, not the batch's
                        r.future.set_exception(e)
                        continue
                    got = [Sampled(g.ids, g.logprobs, g.finish_reason, t) for g, t in zip(got, tops)]
                r.future.set_result(got)
