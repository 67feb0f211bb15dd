"""Measure what the reward gate (trajflow.gates) costs per iteration.

Prints, for a fresh process:
  * import + context start-up: ``import great_expectations`` plus the ephemeral context, data
    source and assets (paid once per process);
  * first validation: the first ``run_gate`` after start-up (parses the suite file, builds the
    GX suites);
  * steady state: median of 5 ``run_gate`` calls on fresh 1,000-row views (new data each time,
    with history so the drift check runs), plus min/max;
  * optionally ``--rows`` other sizes, and ``write_data_docs`` once.

Usage: .venv/bin/python benchmarks/gate.py [--rows 1000] [--repeats 5] [--docs]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pyarrow as pa  # noqa: E402


def make_view(n: int, seed: int, group_size: int = 8) -> pa.Table:
    """A realistic gate view: scores in {0, 0.1, 1, 1.1}, a few NaNs, truncations and errors."""
    rng = random.Random(seed)
    scores = [rng.choice([0.0, 0.1, 1.0, 1.1]) for _ in range(n)]
    errors = [None] * n
    for i in rng.sample(range(n), max(1, n // 100)):
        scores[i] = float("nan")
    for i in rng.sample(range(n), max(1, n // 200)):
        errors[i] = "TimeoutError: scorer took too long"
    return pa.table({
        "sample_id": pa.array([f"it{seed}-s{i}" for i in range(n)], pa.string()),
        "group_id": pa.array([f"it{seed}-g{i // group_size}" for i in range(n)], pa.string()),
        "iteration": pa.array([seed] * n, pa.int64()),
        "score": pa.array(scores, pa.float32()),
        "response_length": pa.array([rng.randint(1, 32) for _ in range(n)], pa.int32()),
        "finish_reason": pa.array([rng.choice(["stop"] * 9 + ["length"]) for _ in range(n)]),
        "reward_error": pa.array(errors, pa.string()),
    })


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1000])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--docs", action="store_true", help="also time write_data_docs once")
    args = ap.parse_args()

    from trajflow import gates
    from trajflow.config import GatesConfig
    from trajflow.gates.runtime import gx_runtime

    settings = GatesConfig(
        score_min=0.0, score_max=1.1, max_equal_group_frac=0.95,
        max_truncated_frac=0.5, max_error_rate=0.1, drift_band=0.5, drift_window=5,
        policies={"score_not_null": "quarantine", "score_finite": "quarantine"})

    t0 = time.perf_counter()
    rt = gx_runtime()  # import great_expectations + ephemeral context + data assets
    startup = time.perf_counter() - t0
    print(f"import great_expectations:            {rt.import_s:7.3f} s")
    print(f"import + context start-up:            {startup:7.3f} s")

    n0 = args.rows[0]
    t0 = time.perf_counter()
    report = gates.run_gate(make_view(n0, 0), settings, max_new_tokens=32, history=[0.5])
    first = time.perf_counter() - t0
    print(f"first validation ({n0} rows):        {first:7.3f} s  "
          f"(success={report.success}, quarantined={len(report.quarantined_sample_ids)})")

    for n in args.rows:
        times = []
        for k in range(args.repeats):
            view = make_view(n, k + 1)
            t0 = time.perf_counter()
            report = gates.run_gate(view, settings, max_new_tokens=32, history=[0.5, 0.55, 0.6])
            times.append(time.perf_counter() - t0)
        print(f"steady state ({n} rows), median of {args.repeats}: {statistics.median(times):7.3f} s"
              f"  (min {min(times):.3f}, max {max(times):.3f})")

    if args.docs:
        with tempfile.TemporaryDirectory() as d:
            t0 = time.perf_counter()
            gates.write_data_docs(report, d)
            print(f"write_data_docs:                      {time.perf_counter() - t0:7.3f} s")


if __name__ == "__main__":
    main()
