"""Synchronous vs off-policy (``trainer.max_staleness=1``, and more with ``--staleness``) iterations,
rollout and actor on separate pools of one CPU each: iteration throughput ratios and a timeline of
when each worker was busy.

Runs the ``train`` flow (real Prefect, Ray, Parquet store, MLflow on SQLite) twice with the same
recipe, seed and split placement (``resources.placement=split``, pool ``train`` for the actor,
pool ``gen`` for separate rollout workers), once with ``trainer.max_staleness=0`` and once with each
value of ``--staleness`` (default 1),
and prints per mode the seconds per iteration after ``--warmup`` iterations (update end to update end), the
iterations per minute, the ratio, and the median seconds of generation and update. The busy
intervals come from the run store: a rollout ends when its ``rollout.parquet`` is written
(``written_at`` in the manifest) and lasted ``timing_s/gen``; an update ends when its
``update.json`` is written and lasted ``timing_s/update_actor`` (both from MLflow).

    python benchmarks/overlap.py [--iterations 6] [--warmup 1] [--staleness 1 2] [--tiny [DIR]]
                                 [--png overlap_timeline.png] [key=value ...]

``--tiny`` uses a tiny random model (seconds, for checking the script; the ratio is then mostly
overhead). The overlap can at best hide the shorter of generation and update: with generation g
and update u per iteration, sync takes ~g+u and overlapped ~max(g, u), a ratio of at most
(g+u)/max(g, u) <= 2, less whatever the two pools still share (the driver, reward tasks, memory
bandwidth of a 2-core machine).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trajflow.infra.env import configure_environment  # noqa: E402

configure_environment()

from _common import scratch_dir  # noqa: E402

POOLS = "resources.pools={train: {num_cpus_per_worker: 1}, gen: {num_cpus_per_worker: 1}}"
SPLIT = ["resources.placement=split", POOLS, "actor.pool=train", "rollout.pool=gen", "trainer.num_threads=1"]


def busy_intervals(run_dir: Path, mlflow_uri: str, mlflow_run_id: str, iterations: int) -> dict[str, list]:
    """``{"rollout": [(it, start, end)], "actor": [(it, start, end)]}`` in wall-clock seconds."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=mlflow_uri)

    def hist(name: str) -> dict[int, float]:
        return {m.step: m.value for m in client.get_metric_history(mlflow_run_id, name)}

    gen, upd = hist("timing_s/gen"), hist("timing_s/update_actor")
    out: dict[str, list] = {"rollout": [], "actor": []}
    for it in range(1, iterations + 1):
        d = run_dir / "iterations" / f"{it:06d}"
        end_r = json.loads((d / "manifest.json").read_text())["files"]["rollout"]["written_at"]
        out["rollout"].append((it, end_r - gen[it], end_r))
        end_u = os.stat(d / "update.json").st_mtime
        out["actor"].append((it, end_u - upd[it], end_u))
    return out


def run_mode(staleness: int, args, root: Path) -> dict:
    from trajflow.flows.train import train

    store = root / f"staleness{staleness}"
    overrides = [f"store.root={store}", f"trainer.total_iterations={args.iterations}", "trainer.test_freq=0",
                 "trainer.save_freq=0", "trainer.progress=false", "trainer.log_samples=0", *SPLIT,
                 f"trainer.max_staleness={staleness}", *args.overrides]
    if args.tiny:
        overrides += [f"model.path={args.tiny}", "data.train_batch_size=4", "rollout.max_new_tokens=16"]
    t0 = time.perf_counter()
    summary = train(None, overrides, run_id=f"overlap-s{staleness}")
    wall = time.perf_counter() - t0
    run_dir = Path(summary["run_dir"])
    spans = busy_intervals(run_dir, f"sqlite:///{store / 'mlflow.db'}", summary["mlflow_run_id"], args.iterations)
    ends = [e for _, _, e in spans["actor"]]
    w = args.warmup  # the first iterations load, compile and open the audit table: not steady state
    steady = (ends[-1] - ends[w - 1]) / (args.iterations - w)
    return {"staleness": staleness, "wall_s": wall, "s_per_it": steady, "spans": spans,
            "gen_s": statistics.median(e - s for _, s, e in spans["rollout"][w:]),
            "update_s": statistics.median(e - s for _, s, e in spans["actor"][w:])}


def plot(results: list[dict], png: Path, title=None) -> None:
    """One timeline row per result: the rollout worker's and the policy worker's busy spans, numbered by
    iteration; ``title(result)`` names each row (default: its staleness and steady s/iteration)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 1, figsize=(11, 1.9 * len(results) + 0.6), sharex=True, squeeze=False)
    for ax, res in zip(axes[:, 0], results):
        t0 = min(s for rows in res["spans"].values() for _, s, _ in rows)
        for y, (worker, color) in enumerate((("rollout", "tab:blue"), ("actor", "tab:orange"))):
            for it, s, e in res["spans"][worker]:
                ax.barh(y, e - s, left=s - t0, color=color, edgecolor="black", linewidth=0.5)
                ax.text(s - t0 + (e - s) / 2, y, str(it), ha="center", va="center", fontsize=7)
        ax.set_yticks([0, 1], ["rollout worker (gen)", "policy worker (update)"])
        ax.set_title(title(res) if title else
                     f"trainer.max_staleness={res['staleness']}: {res['s_per_it']:.1f} s/iteration after the warm-up",
                     fontsize=9)
    axes[-1, 0].set_xlabel("seconds since the first rollout began")
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=1, help="iterations left out of the steady-state numbers")
    ap.add_argument("--tiny", nargs="?", const="make", default=None,
                    help="a tiny random model (a folder, or made in the scratch folder when given bare)")
    ap.add_argument("--staleness", type=int, nargs="+", default=[1], help="the max_staleness values run after the sync one")
    ap.add_argument("--png", type=Path, default=Path("overlap_timeline.png"))
    ap.add_argument("--keep", action="store_true", help="keep the run directories (removed at exit otherwise)")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    if not 1 <= args.warmup < args.iterations:
        ap.error("need 1 <= --warmup < --iterations")
    if any(k < 1 for k in args.staleness):
        ap.error("--staleness values must be >= 1 (0, the sync run, always runs)")
    root = scratch_dir("trajflow-overlap-", args.keep)
    if args.tiny == "make":
        from tests.conftest import make_tiny_model

        args.tiny = str(make_tiny_model(root / "tiny-model"))
    import ray

    # One Ray for both runs: a run that starts Ray stops it at the end, and with it the watcher that
    # keeps Prefect's temporary server alive for the next flow of this process.
    ray.init(num_cpus=max(2, os.cpu_count() or 2), include_dashboard=False, log_to_driver=False)
    load = os.getloadavg()
    results = [run_mode(k, args, root) for k in [0, *args.staleness]]
    load_after = os.getloadavg()
    modes = ", ".join(f"trainer.max_staleness={k}" for k in args.staleness)
    print(f"\n=== sync vs {modes}, {args.iterations} iterations, rollout and actor on one CPU each ===")
    for r in results:
        print(f"max_staleness={r['staleness']}: {r['s_per_it']:.2f} s/iteration (iterations {args.warmup + 1}.."
              f"{args.iterations}), "
              f"{60 / r['s_per_it']:.2f} iterations/min; median gen {r['gen_s']:.2f} s, update {r['update_s']:.2f} s; "
              f"whole run {r['wall_s']:.0f} s")
    bound = (results[0]["gen_s"] + results[0]["update_s"]) / max(results[0]["gen_s"], results[0]["update_s"])
    for r in results[1:]:
        print(f"iteration throughput ratio (staleness {r['staleness']} / sync): {results[0]['s_per_it'] / r['s_per_it']:.2f}x"
              f"  (ideal for these stage times: {bound:.2f}x)")
    print(f"load average before: {' '.join(f'{x:.2f}' for x in load)}; after: "
          f"{' '.join(f'{x:.2f}' for x in load_after)}; CPUs: {os.cpu_count()}")
    plot(results, args.png)
    print(f"timeline: {args.png.resolve()}")


if __name__ == "__main__":
    main()
