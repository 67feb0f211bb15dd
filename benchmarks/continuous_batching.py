"""Generation of the default recipe's batch with and without continuous batching, side by side.

The default recipe samples 8 prompts x 8 = 64 rows with 32 decode slots (``rollout.micro_batch_size``).
Without continuous batching the first 4 prompts decode until their longest response ends (most steps
then run a handful of rows), then the next 4; with it, a prompt starts as soon as 8 slots are free.
Both settings run alternately on one in-process policy worker, on the same prompts and seeds (the
same samples, up to float rounding), so the ratio is measured inside one run.

Prints per repeat: seconds, real tokens, decode steps (forwards after the prefills), mean rows per
step, real tok/s; then the medians, the ratio, and each setting's steps against the fewest any
scheduler with that many slots needs (``max(longest response, ceil(tokens / slots))``).
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

from _common import first_batch_prompts, header, policy_worker, preload_allocator, set_all_threads


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="smoke test: 1 repeat, 16 new tokens")
    ap.add_argument("overrides", nargs="*", help="config overrides (key=value)")
    args = ap.parse_args()
    print(f"allocator: {preload_allocator('auto')}", flush=True)
    import torch

    from trajflow.config import load_config
    from trajflow.stages.rollout import SamplingParams

    overrides = list(args.overrides) + (["rollout.max_new_tokens=16"] if args.quick else [])
    repeats = 1 if args.quick else args.repeats
    threads = set_all_threads()
    cfg = load_config(None, overrides)
    worker = policy_worker(cfg)
    _, prompt_ids = first_batch_prompts(cfg, worker)
    slots, n, T = int(cfg.rollout.micro_batch_size), int(cfg.rollout.n), int(cfg.rollout.max_new_tokens)
    print(f"torch {torch.__version__}, {threads} threads; {cfg.model.path}, {len(prompt_ids)} prompts x {n} samples, "
          f"{slots} decode slots, up to {T} new tokens, rollout dtype {worker.rollout.dtype}; {repeats} repeat(s)")

    engine = worker.engine
    worker.generate_sequences(prompt_ids[:1], SamplingParams(n=2, max_new_tokens=4, seed=0), False)  # warm-up
    results: dict[str, list[dict]] = {"continuous": [], "per group": []}
    header("runs (alternating)")
    for r in range(repeats):
        for label, join in (("per group", False), ("continuous", True)):
            engine.continuous_batching = join
            params = SamplingParams(n=n, temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                                    top_k=cfg.rollout.top_k, max_new_tokens=T, seed=1000 + r)
            t = time.perf_counter()
            out = engine.generate(prompt_ids, params)
            secs = time.perf_counter() - t
            lens = [len(x) for x in out.response_ids]
            row = dict(s=secs, tokens=sum(lens), longest=max(lens), steps=out.stats["decode_steps"],
                       rows=out.stats["decode_rows_mean"], rate=sum(lens) / secs)
            results[label].append(row)
            print(f"repeat {r} {label:>10}: {secs:6.2f} s, {row['tokens']} tokens (longest {row['longest']}), "
                  f"{row['steps']} decode steps of {row['rows']:.1f} rows on average: {row['rate']:.1f} tok/s")

    header("summary (medians)")
    med = {k: {f: statistics.median(x[f] for x in v) for f in ("s", "steps", "rows", "rate")}
           for k, v in results.items()}
    fewest = max(max(x["longest"] for x in results["continuous"]) - 1,
                 math.ceil(statistics.median(x["tokens"] for x in results["continuous"]) / slots) - 1)
    for k, m in med.items():
        print(f"{k:>10}: {m['s']:.2f} s, {m['steps']:.0f} steps ({m['rows']:.1f} rows each), {m['rate']:.1f} tok/s")
    print(f"fewest decode steps any {slots}-slot schedule needs for the last batch: ~{fewest}")
    print(f"continuous / per group tok/s: {med['continuous']['rate'] / med['per group']['rate']:.2f}x; "
          f"steps {med['per group']['steps'] / max(1, med['continuous']['steps']):.2f}x fewer")


if __name__ == "__main__":
    main()
