"""On-policy distillation against RL alone: each run's held-out accuracy at each validation, with the wall
seconds it had trained for by then.

Reads the runs' metrics from the store's MLflow database (``sqlite:///<store>/mlflow.db``, or
``--tracking-uri``; never a URI named by a run folder). Prints one Markdown table per run and one
table of every run's accuracy at each validated iteration, for the README.

    .venv/bin/python benchmarks/opd_vs_rl.py --store runs TEACHER_RUN STUDENT_RUN [MORE_RUNS ...]

Columns: ``iteration``; ``training s``, the sum of ``timing_s/step`` up to that iteration (rollout,
reward, teacher or reference scoring, advantage and update; validations excluded, as they cost the
same for every run); ``elapsed s``, seconds from the run's MLflow start to that validation's metric
(validations and start-up included); ``acc``, ``val-core/<source>/acc/mean@1`` (greedy, the recipe's
held-out problems); ``score``, ``critic/score/mean`` of that iteration's samples; ``reverse KL``,
``distill/reverse_kl`` (k1 estimate of KL(student || teacher) per token; distillation runs only).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

_REPO = Path(__file__).resolve().parents[1]
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))


def run_curve(client, mlflow_run_id: str) -> dict:
    """``{"acc": {step: value}, "train_s": {step: seconds}, "elapsed_s": {step: seconds}, "score": ..., "kl": ...}``."""
    info = client.get_run(mlflow_run_id).info

    def hist(key: str) -> dict[int, object]:
        return {m.step: m for m in client.get_metric_history(mlflow_run_id, key)}

    acc_keys = sorted(k for k in client.get_run(mlflow_run_id).data.metrics
                      if k.startswith("val-core/") and "/acc/mean" in k)
    if not acc_keys:
        raise SystemExit(f"error: MLflow run {mlflow_run_id} has no val-core/*/acc metric (validate with trainer.test_freq)")
    acc = hist(acc_keys[0])
    steps = {s: m.value for s, m in hist("timing_s/step").items()}
    return {
        "metric": acc_keys[0],
        "acc": {s: m.value for s, m in acc.items()},
        "train_s": {s: sum(v for k, v in steps.items() if k <= s) for s in acc},
        "elapsed_s": {s: (m.timestamp - info.start_time) / 1000.0 for s, m in acc.items()},
        "score": {s: m.value for s, m in hist("critic/score/mean").items()},
        "kl": {s: m.value for s, m in hist("distill/reverse_kl").items()},
    }


def _f(x: float | None, spec: str) -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", help="trajflow run ids (folders of the store)")
    p.add_argument("--store", default="runs", help="the store root (default ./runs)")
    p.add_argument("--tracking-uri", default=None, help="MLflow tracking URI (default: the store's SQLite file)")
    args = p.parse_args(argv)

    from mlflow.tracking import MlflowClient

    from trajflow.tracking import store_tracking_uri

    root = Path(args.store).expanduser().resolve()
    client = MlflowClient(args.tracking_uri or store_tracking_uri(str(root)))
    curves = {}
    for run in args.runs:
        meta_path = root / run / "run.json"
        if not meta_path.exists():
            raise SystemExit(f"error: {meta_path}: no such run folder")
        curves[run] = run_curve(client, json.loads(meta_path.read_text())["mlflow_run_id"])
    for run, c in curves.items():
        print(f"\n{run} ({c['metric']})\n")
        print("| iteration | training s | elapsed s | acc | score | reverse KL |")
        print("|---|---|---|---|---|---|")
        for s in sorted(c["acc"]):
            print(f"| {s} | {_f(c['train_s'][s], '.0f')} | {_f(c['elapsed_s'][s], '.0f')} | {c['acc'][s]:.3f} | "
                  f"{_f(c['score'].get(s), '.3f')} | {_f(c['kl'].get(s), '.3f')} |")
    steps = sorted({s for c in curves.values() for s in c["acc"]})
    print("\n| iteration | " + " | ".join(curves) + " |")
    print("|---|" + "---|" * len(curves))
    for s in steps:
        print(f"| {s} | " + " | ".join(
            f"{c['acc'][s]:.3f} ({c['train_s'][s]:.0f} s)" if s in c["acc"] else "—" for c in curves.values()) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
