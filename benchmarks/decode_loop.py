"""The HF engine's decode loop before and after its speed-ups, on the default recipe's rollout batch.

The default recipe samples 8 prompts x 8 rows with 32 decode slots from a bf16 rollout copy. Six
settings of one in-process policy worker's engine run alternately on the same prompts and seeds:

- ``before``: the loop as it was: a prompt starts only when ``n`` slots are free, each step
  concatenates the KV cache (``torch.cat`` per layer), plain ``F.linear`` on the bf16 copy;
- ``+ packed``: the bf16 copy's linear weights packed for oneDNN once per sync
  (:mod:`trajflow.modeling.packed_linear`);
- ``+ in-place cache``: keys and values appended in place (:mod:`trajflow.engines.kv_cache`);
- ``+ split groups``: also free slots filled row by row (``split_groups``);
- ``+ lean step``: also each decode forward through :func:`trajflow.engines.decode_step.decode_step`
  (``lean_step``: the layers without the model forward's per-call machinery);
- ``after``: also ended rows' places in the KV cache reused by the next rows (``reuse_slots``: no
  whole-cache copies when rows come and go), the engine's default.

Prints per run: wall seconds, CPU seconds of this process, real tokens, decode steps, mean rows per
step, tok/s, and whether the tokens equal the ``before`` run's (they should: every change keeps the
samples); then per setting the median tok/s (wall and per CPU second) and the ratio to ``before``,
with PASS/MISS against the issue's target (generation >= 2x the loop before). On a loaded machine
use ``--threads 1`` and read the per-CPU-second ratio: oversubscribed OpenMP threads inflate wall time
unevenly.

    .venv/bin/python benchmarks/decode_loop.py [--repeats 3] [--threads N] [--slots S] [--quick] [key=value ...]
"""

from __future__ import annotations

import argparse
import statistics
import time

from _common import first_batch_prompts, header, policy_worker, preload_allocator, set_all_threads, verdict

TARGET = 2.0
SETTINGS = {  # label: (pack_weights, in_place_cache, split_groups, lean_step, reuse_slots)
    "before": (False, False, False, False, False),
    "+ packed": (True, False, False, False, False),
    "+ in-place cache": (True, True, False, False, False),
    "+ split groups": (True, True, True, False, False),
    "+ lean step": (True, True, True, True, False),
    "after": (True, True, True, True, True),
}


def divergence(ref, out) -> dict:
    """How far ``out`` is from ``ref`` (same prompts and seed): rows with identical tokens, and the
    largest difference of the sampler's log-probs over each row's tokens up to where the two differ
    (a different batch composition changes float rounding, and a sample that falls near a CDF step
    can flip: the measure of how close the two loops' distributions are)."""
    same, worst = 0, 0.0
    for a, b, la, lb in zip(ref.response_ids, out.response_ids, ref.rollout_logprobs or [], out.rollout_logprobs or []):
        same += a == b
        # Tokens before the first difference: the same token after the same context in both.
        k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        if k:
            worst = max(worst, max(abs(x - y) for x, y in zip(la[:k], lb[:k])))
    return dict(rows_same=same, max_lp_diff=worst)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: all CPUs)")
    ap.add_argument("--quick", action="store_true", help="smoke test: 1 repeat, 16 new tokens")
    ap.add_argument("--slots", type=int, default=0,
                    help="also run the engine's default with this many decode slots (e.g. 64: every row of the "
                         "default batch at once; its RNG groups differ, so its samples do too)")
    ap.add_argument("overrides", nargs="*", help="config overrides (key=value)")
    args = ap.parse_args()
    print(f"allocator: {preload_allocator('auto')}", flush=True)
    import torch

    from trajflow.config import load_config
    from trajflow.stages.rollout import SamplingParams

    overrides = list(args.overrides) + (["rollout.max_new_tokens=16"] if args.quick else [])
    repeats = 1 if args.quick else args.repeats
    cfg = load_config(None, overrides)
    worker = policy_worker(cfg)
    threads = set_all_threads()
    if args.threads:
        torch.set_num_threads(threads := args.threads)
    _, prompt_ids = first_batch_prompts(cfg, worker)
    engine = worker.engine
    n, T = int(cfg.rollout.n), int(cfg.rollout.max_new_tokens)
    print(f"torch {torch.__version__}, {threads} thread(s); {cfg.model.path}, {len(prompt_ids)} prompts x {n}, "
          f"{engine.micro_batch_size} decode slots, up to {T} new tokens, rollout dtype {worker.rollout.dtype}; "
          f"{repeats} repeat(s)")

    slots = engine.micro_batch_size
    settings = dict(SETTINGS)
    if args.slots:
        settings[f"after, {args.slots} slots"] = SETTINGS["after"]

    def use(label: str) -> None:
        engine.micro_batch_size = args.slots if label.endswith(" slots") else slots
        (engine.pack_weights, engine.in_place_cache, engine.split_groups, engine.lean_step,
         engine.reuse_slots) = settings[label]
        if engine.pack_weights:
            engine._pack()
        else:
            engine._unpack(restore=True)

    engine.generate(prompt_ids[:1], SamplingParams(n=2, max_new_tokens=4, seed=0))  # warm-up
    runs: dict[str, list[dict]] = {label: [] for label in settings}
    header("runs (alternating)")
    for r in range(repeats):
        first = None
        for label in settings:
            use(label)
            params = SamplingParams(n=n, temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                                    top_k=cfg.rollout.top_k, max_new_tokens=T, seed=1000 + r)
            t, c = time.perf_counter(), time.process_time()
            out = engine.generate(prompt_ids, params)
            wall, cpu = time.perf_counter() - t, time.process_time() - c
            first = first or out
            tokens = sum(len(x) for x in out.response_ids)
            row = dict(wall=wall, cpu=cpu, rate=tokens / wall, cpu_rate=tokens / cpu, steps=out.stats["decode_steps"],
                       same=out.response_ids == first.response_ids, **divergence(first, out))
            runs[label].append(row)
            print(f"repeat {r} {label:>17}: {wall:6.2f} s ({cpu:6.2f} CPU s), {tokens} tokens, {row['steps']} decode "
                  f"steps of {out.stats['decode_rows_mean']:.1f} rows: {row['rate']:.1f} tok/s "
                  f"({row['cpu_rate']:.1f} per CPU s); tokens as before: {row['same']} ({row['rows_same']} of "
                  f"{len(out.response_ids)} rows; log-probs of the tokens both wrote differ by at most "
                  f"{row['max_lp_diff']:.2g})", flush=True)
    use("after")

    header("summary (medians)")
    med = {label: {k: statistics.median(x[k] for x in v) for k in ("rate", "cpu_rate", "steps")}
           for label, v in runs.items()}
    for label, m in med.items():
        print(f"{label:>17}: {m['rate']:.1f} tok/s ({m['rate'] / med['before']['rate']:.2f}x), "
              f"{m['cpu_rate']:.1f} tok per CPU s ({m['cpu_rate'] / med['before']['cpu_rate']:.2f}x), "
              f"{m['steps']:.0f} decode steps")
    print(f"tokens identical to the loop before in every run: {all(x['same'] for v in runs.values() for x in v)}")
    for label, v in runs.items():
        print(f"{label:>17}: rows identical to the loop before {min(x['rows_same'] for x in v)}+ per run; largest "
              f"log-prob difference on the tokens both wrote {max(x['max_lp_diff'] for x in v):.2g}")
    header("targets")
    verdict("generation tok/s, after / before (wall)", med["after"]["rate"] / med["before"]["rate"], TARGET,
            fmt="{:.2f}x")
    print(f"      (per CPU second: {med['after']['cpu_rate'] / med['before']['cpu_rate']:.2f}x)")
    for label in settings:
        if label.endswith(" slots"):
            print(f"      ({label}: {med[label]['rate'] / med['before']['rate']:.2f}x wall, "
                  f"{med[label]['cpu_rate'] / med['before']['cpu_rate']:.2f}x per CPU second)")


if __name__ == "__main__":
    main()
