"""Synchronous vs ``trainer.max_staleness=1`` vs partial rollouts on a workload with long-tailed
response lengths: seconds per iteration, the trainer's idle fraction, the staleness distribution per
token and per row, a timeline PNG, and (with ``--validate``) held-out accuracy at the last iteration.

Runs the ``train`` flow (real Prefect, Ray, Parquet store, MLflow on SQLite) once per mode with the
same recipe, seed and split placement (rollout workers and policy worker on one-CPU pools):

- ``sync``: ``trainer.max_staleness=0``;
- ``overlap``: ``trainer.max_staleness=1`` (rollout k+1 beside update k, whole rollouts);
- ``partial``: ``trainer.max_staleness=2 trainer.partial_rollout=true`` (segment k+1 beside update k,
  rows may finish one segment later);
- ``partial1``: ``trainer.max_staleness=1 trainer.partial_rollout=true`` (no overlap of segments, the
  long tail finished one version later).

Per mode it prints: s/iteration after ``--warmup`` iterations (update end to update end), the
trainer's idle fraction over those iterations (1 - time the policy worker spent in updates / wall
time), the response-length percentiles (the tail), the staleness of every trained token and row
(trainer version at the update minus the version that sampled it / the row's oldest token), and
PASS/MISS for the speed-up of each mode over ``sync`` (``--target``, default 1.0: faster at all) and,
with ``--validate``, for the held-out accuracy at the last iteration within ``--tolerance`` (0.05) of
``sync``'s.

    python benchmarks/partial_rollout.py [--modes sync overlap partial] [--iterations 6] [--warmup 2]
        [--validate] [--tiny [DIR]] [--png partial_rollout_timeline.png] [key=value ...]

The default workload is the default recipe with a 256-token response cap (most answers are short,
a few run to the cap); pass overrides to scale it (``data.train_batch_size=4 rollout.n=4``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import scratch_dir, verdict  # noqa: E402  (puts the repository first on sys.path)
from overlap import SPLIT, busy_intervals, plot  # noqa: E402

MODES = {"sync": ["trainer.max_staleness=0"], "overlap": ["trainer.max_staleness=1"],
         "partial": ["trainer.max_staleness=2", "trainer.partial_rollout=true"],
         "partial1": ["trainer.max_staleness=1", "trainer.partial_rollout=true"]}


def staleness(run_dir: Path, iterations: int) -> dict[str, list[int]]:
    """Staleness of every trained token and row: the trainer's version at iteration k's update is k - 1."""
    import pyarrow.parquet as pq

    tokens: list[int] = []
    rows: list[int] = []
    lengths: list[int] = []
    for it in range(1, iterations + 1):
        t = pq.read_table(run_dir / "iterations" / f"{it:06d}" / "rollout.parquet")
        lens = [len(r) for r in t.column("response_ids").to_pylist()]
        lengths += lens
        if "token_policy_versions" in t.column_names:
            for v in t.column("token_policy_versions").to_pylist():
                tokens += [it - 1 - x for x in v]
        else:
            for v, n in zip(t.column("policy_version").to_pylist(), lens):
                tokens += [it - 1 - v] * n
        rows += [it - 1 - v for v in t.column("policy_version").to_pylist()]
    return {"tokens": tokens, "rows": rows, "lengths": lengths}


def histogram(values: list[int]) -> str:
    if not values:
        return "-"
    counts = {k: values.count(k) for k in sorted(set(values))}
    return ", ".join(f"{k}: {c / len(values):.2f}" for k, c in counts.items())


def run_mode(mode: str, args, root: Path) -> dict:
    from trajflow.flows.train import train

    store = root / mode
    freq = args.iterations if args.validate else 0
    overrides = [f"store.root={store}", f"trainer.total_iterations={args.iterations}", f"trainer.test_freq={freq}",
                 "trainer.val_before_train=false", "trainer.save_freq=0", "trainer.progress=false",
                 "trainer.log_samples=0", f"trainer.seed={args.seed}", *SPLIT, *MODES[mode],
                 f"rollout.max_new_tokens={args.max_new_tokens}", *args.overrides]
    if args.tiny:
        overrides += [f"model.path={args.tiny}", "data.train_batch_size=4"]
    t0 = time.perf_counter()
    summary = train(None, overrides, run_id=f"partial-{mode}")
    wall = time.perf_counter() - t0
    run_dir = Path(summary["run_dir"])
    spans = busy_intervals(run_dir, f"sqlite:///{store / 'mlflow.db'}", summary["mlflow_run_id"], args.iterations)
    ends = [e for _, _, e in spans["actor"]]
    w = args.warmup
    window = ends[-1] - ends[w - 1]
    busy = sum(e - s for _, s, e in spans["actor"][w:])
    acc = None
    if args.validate:
        meta = json.loads((run_dir / "run.json").read_text())
        val = meta.get(f"validation_{args.iterations:06d}", {})
        accs = [v for k, v in val.items() if k.startswith("val-core/") and "/acc/" in k]
        acc = float(accs[0]) if accs else None
    return {"mode": mode, "wall_s": wall, "s_per_it": window / (args.iterations - w), "idle": 1 - busy / window,
            "spans": spans, "stale": staleness(run_dir, args.iterations), "acc": acc,
            "gen_s": statistics.median(e - s for _, s, e in spans["rollout"][w:]),
            "update_s": statistics.median(e - s for _, s, e in spans["actor"][w:])}


def title(res: dict) -> str:
    return (f"{res['mode']} ({' '.join(MODES[res['mode']])}): {res['s_per_it']:.1f} s/iteration, "
            f"trainer idle {res['idle']:.0%}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", nargs="+", default=["sync", "overlap", "partial"], choices=list(MODES))
    ap.add_argument("--iterations", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2, help="iterations left out of the steady-state numbers")
    ap.add_argument("--max-new-tokens", type=int, default=256, help="the response cap (the long tail)")
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--validate", action="store_true", help="score the held-out prompts after the last iteration")
    ap.add_argument("--tolerance", type=float, default=0.05, help="--validate: accuracy within this of sync's")
    ap.add_argument("--target", type=float, default=1.0, help="PASS when a mode's s/iteration speed-up over sync >= this")
    ap.add_argument("--tiny", nargs="?", const="make", default=None,
                    help="a tiny random model (a folder, or made in the scratch folder when given bare)")
    ap.add_argument("--png", type=Path, default=Path("partial_rollout_timeline.png"))
    ap.add_argument("--keep", action="store_true", help="keep the run directories (removed at exit otherwise)")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    if not 1 <= args.warmup < args.iterations:
        ap.error("need 1 <= --warmup < --iterations")
    root = scratch_dir("trajflow-partial-", args.keep)
    if args.tiny == "make":
        from tests.conftest import make_tiny_model

        args.tiny = str(make_tiny_model(root / "tiny-model"))
    import ray

    ray.init(num_cpus=max(2, os.cpu_count() or 2), include_dashboard=False, log_to_driver=False)
    load = os.getloadavg()
    results = []
    for mode in args.modes:
        results.append(run_mode(mode, args, root))
        r = results[-1]
        print(f"[{mode}] {r['s_per_it']:.2f} s/iteration, trainer idle {r['idle']:.2f}, run {r['wall_s']:.0f} s",
              flush=True)
    load_after = os.getloadavg()
    print(f"\n=== {' vs '.join(args.modes)}: {args.iterations} iterations (steady state from {args.warmup + 1}), "
          f"cap {args.max_new_tokens} tokens, seed {args.seed}, rollout and actor on one CPU each ===")
    for r in results:
        lens = sorted(r["stale"]["lengths"])
        pct = {q: lens[min(len(lens) - 1, int(q * len(lens)))] for q in (0.5, 0.9)}
        print(f"{r['mode']:9s} {r['s_per_it']:7.2f} s/iteration  trainer idle {r['idle']:.2f}  median gen "
              f"{r['gen_s']:.1f} s, update {r['update_s']:.1f} s  response length p50 {pct[0.5]} p90 {pct[0.9]} "
              f"max {lens[-1]}" + (f"  held-out acc {r['acc']:.3f}" if r["acc"] is not None else ""))
        print(f"          staleness per token {{{histogram(r['stale']['tokens'])}}}, per row (oldest token) "
              f"{{{histogram(r['stale']['rows'])}}}")
    base = next((r for r in results if r["mode"] == "sync"), None)
    if base is not None:
        for r in results:
            if r is base:
                continue
            verdict(f"{r['mode']} speed-up over sync (s/iteration)", base["s_per_it"] / r["s_per_it"], args.target,
                    fmt="{:.2f}")
            if args.validate and r["acc"] is not None and base["acc"] is not None:
                verdict(f"{r['mode']} |held-out acc - sync's|", abs(r["acc"] - base["acc"]), args.tolerance,
                        higher_is_better=False)
    print(f"load average before: {' '.join(f'{x:.2f}' for x in load)}; after: "
          f"{' '.join(f'{x:.2f}' for x in load_after)}; CPUs: {os.cpu_count()}")
    plot(results, args.png, title)
    print(f"timeline: {args.png.resolve()}")


if __name__ == "__main__":
    main()
