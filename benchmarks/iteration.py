"""Seconds per stage and tokens per second for the default recipe (real model, real pipeline).

Runs the default recipe for a few iterations through the real `train` flow (Prefect, Ray, Parquet
store, MLflow on SQLite) and prints, per iteration and as medians over the iterations after the
first (warm-up), the seconds of each stage and the generation/update token rates.

    python benchmarks/iteration.py [--iterations 4] [key=value ...]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trajflow.infra.env import configure_environment  # noqa: E402

configure_environment()

from _common import scratch_dir  # noqa: E402

STAGES = ["timing_s/gen", "timing_s/old_log_prob", "timing_s/reward", "timing_s/gate", "timing_s/adv",
          "timing_s/update_actor", "timing_s/step"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=4)
    ap.add_argument("--keep", action="store_true", help="keep the run directories (removed at exit otherwise)")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    from mlflow.tracking import MlflowClient

    from trajflow.flows.train import train
    from trajflow.config import load_config

    root = scratch_dir("trajflow-bench-", args.keep)
    overrides = [f"store.root={root}", f"trainer.total_iterations={args.iterations}", "trainer.test_freq=0",
                 "trainer.save_freq=0", "trainer.progress=false", *args.overrides]
    t0 = time.perf_counter()
    summary = train(None, overrides)
    wall = time.perf_counter() - t0
    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
    rid = summary["mlflow_run_id"]

    def hist(name: str) -> list[float]:
        return [m.value for m in sorted(client.get_metric_history(rid, name), key=lambda m: m.step)]

    rows = {name: hist(name) for name in STAGES + ["response_length/mean", "perf/total_num_tokens",
                                                     "perf/throughput", "perf/actor_rss_gb"]}
    cfg = load_config(None, overrides)
    n_rows = cfg.data.train_batch_size * cfg.rollout.n
    n_resp = [r * n_rows for r in rows["response_length/mean"]]
    print(f"default recipe, {args.iterations} iterations, wall {wall:.1f} s (incl. start-up)")
    header = "iter " + " ".join(f"{s.split('/')[-1]:>13}" for s in STAGES) + "   gen tok/s  upd tok/s"
    print(header)
    for i in range(args.iterations):
        gen = n_resp[i] / rows["timing_s/gen"][i]
        upd = rows["perf/total_num_tokens"][i] / rows["timing_s/update_actor"][i]
        vals = " ".join(f"{rows[s][i] if i < len(rows[s]) else float('nan'):13.2f}" for s in STAGES)
        print(f"{i + 1:4d} {vals} {gen:11.1f} {upd:10.1f}")
    warm = slice(1, None) if args.iterations > 1 else slice(0, None)
    print("median over warm iterations:")
    for s in STAGES:
        print(f"  {s:24s} {statistics.median(rows[s][warm]):8.2f} s")
    gen_rate = statistics.median([n / t for n, t in zip(n_resp[warm], rows['timing_s/gen'][warm])])
    upd_rate = statistics.median([n / t for n, t in zip(rows['perf/total_num_tokens'][warm], rows['timing_s/update_actor'][warm])])
    print(f"  generated tokens/s        {gen_rate:8.1f}")
    print(f"  update tokens/s (prompt+response) {upd_rate:8.1f}")
    print(f"  perf/throughput (all tokens / step s) {statistics.median(rows['perf/throughput'][warm]):8.1f}")
    if rows["perf/actor_rss_gb"]:
        print(f"  policy worker RSS         {max(rows['perf/actor_rss_gb']):8.2f} GiB")


if __name__ == "__main__":
    main()
