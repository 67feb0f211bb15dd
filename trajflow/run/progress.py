"""The console's view of a run: one live tqdm line, and one ``step:N - key:value`` line per step.

The printed line has verl's console format (``step:N - key:value - ...``, values with 3 decimals)
and only the metrics that say whether training works; all of them are in MLflow.
"""

from __future__ import annotations

import sys
import time

#: The metrics of a training step's line, in this order (those a step does not have are left out).
STEP_KEYS = ("critic/score/mean", "actor/pg_loss", "KL", "actor/entropy", "actor/grad_norm",
             "response_length/mean", "actor/pg_clipfrac", "timing_s/step")
#: The KL metric shown for ``KL``: the KL loss when it is used, else the KL in the reward, else the
#: policy's KL to the rollout policy (the first present).
KL_KEYS = ("actor/kl_loss", "critic/kl", "actor/ppo_kl")
#: Validation metrics (held-out scores) are shown whenever a step has them.
VALIDATION_PREFIXES = ("val-core/", "val-aux/")


def step_metrics(metrics: dict) -> dict[str, float]:
    """The metrics of :data:`STEP_KEYS` (``KL`` resolved by :data:`KL_KEYS`) and every validation
    metric in ``metrics``, in console order."""
    shown: dict[str, float] = {}
    for key in STEP_KEYS:
        if key == "KL":
            key = next((k for k in KL_KEYS if k in metrics), "")
        if key in metrics:
            shown[key] = metrics[key]
    for key in sorted(metrics):
        if key.startswith(VALIDATION_PREFIXES):
            shown[key] = metrics[key]
    return shown


def step_line(step: int, metrics: dict) -> str:
    """``step:N - key:value - ...`` as verl prints it (numbers with 3 decimals), each key as MLflow and
    every other surface spell it (:func:`trajflow.metric_names.metric_name`: ``mean_at_1``, not ``mean@1``)."""
    from trajflow.metric_names import metric_name

    parts = [f"step:{step}"]
    for key, value in step_metrics(metrics).items():
        key = metric_name(key)
        try:
            parts.append(f"{key}:{float(value):.3f}")
        except (TypeError, ValueError):  # a non-numeric value is shown as it is, never dropped
            parts.append(f"{key}:{value}")
    return " - ".join(parts)


def console_logger(cfg) -> bool:
    """Whether ``trainer.logger`` (verl's key: a list, or one name) asks for the console's ``step:N`` lines."""
    value = cfg.trainer.get("logger", ["console"])
    return "console" in ([value] if isinstance(value, str) else list(value))


def print_step(step: int, metrics: dict) -> None:
    """Print :func:`step_line` on stdout above the live bar (tqdm clears and redraws it)."""
    from tqdm.auto import tqdm

    tqdm.write(step_line(step, metrics), file=sys.stdout)
    sys.stdout.flush()


class Progress:
    """One live line over the run's iterations: reward mean, response length, seconds (tqdm).

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
        """Close the bar; its last state stays on the screen."""
        self.bar.close()
