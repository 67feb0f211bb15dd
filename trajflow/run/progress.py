"""The console's live line: one tqdm bar over the run's iterations."""

from __future__ import annotations

import sys
import time


class Progress:
    """One live line per iteration: reward mean, response length, seconds (tqdm).

    Args:
        total: the run's last iteration.
        start: the first iteration this process trains (the bar starts at ``start - 1`` done).
        enabled: ``trainer.progress``; a disabled bar prints nothing.
    """

    def __init__(self, total: int, start: int, enabled: bool) -> None:
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total, initial=start - 1, desc="train", unit="it", disable=not enabled,
                        dynamic_ncols=True, file=sys.stderr)
        self.t0 = time.perf_counter()
        self.last: dict = {}

    def done(self, iteration: int, metrics: dict) -> None:
        """Advance by one finished iteration and show its score, response length and seconds."""
        self.last = {"score": f"{metrics.get('critic/score/mean', float('nan')):.3f}",
                     "len": f"{metrics.get('response_length/mean', float('nan')):.1f}",
                     "s": f"{metrics.get('timing_s/step', 0.0):.1f}"}
        self.bar.set_description(f"it {iteration} done")
        self.bar.set_postfix(self.last)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()
