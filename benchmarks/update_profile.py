"""Where one policy update of the default recipe spends its time, against the bf16 matmul ceiling.

Runs ``PolicyWorker.update_actor`` in-process (no Ray) on the default recipe's first batch (8 prompts
x 8 samples sampled by the worker itself, GRPO advantages of their reasoning-gym scores), exactly as
``limits.py`` section 3 does, and reports for the recipe's micro-batching:

1. **MFU** of the best of R updates after a warm-up: model FLOPs (``limits.update_flops``: the
   decoder on the tokens trajflow computes, the LM head on response tokens, causal attention) /
   seconds / the matmul ceiling of the update's compute dtype (``torch.mm`` n x n, the higher of a
   measurement before and after). Target: >= 50 % (issue 42).
2. **Phases** of each update, wall seconds: the training forwards (``backend.forward``), the
   backwards, the optimizer step (gradient norm, clipping and fused AdamW: ``backend.step``), the
   weight push to the rollout engine after the update (``_push_weights``: the bf16 rollout copy cast
   and packed again; ``timing_s/update_actor`` includes it) and the rest (packing, losses, metrics).
3. **Operators** of one more update under ``torch.profiler`` (CPU, shapes recorded), grouped: matmuls,
   attention kernels, dtype casts and copies, ``cat``, zero fills, the optimizer kernel, oneDNN weight
   packing, the rest (elementwise work); then the top operators by self time with their shapes.
4. **The matmul-only bound**: every matmul of that update (each shape, as many times as it ran) timed
   alone on contiguous operands, best of R, and summed; the MFU the update would have if nothing but
   those matmuls took time (attention, casts, elementwise work, the optimizer all free). An update
   whose matmuls alone cannot reach the target cannot reach it by trimming the rest.

Every number here is a wall time: on a machine shared with other work they are inflated unevenly
(memory-bound operators more than matmuls); quote them from a quiet machine, with the CPU kind printed first.

    .venv/bin/python benchmarks/update_profile.py [--repeats 3] [--max-new-tokens 64] [--rows 25]
"""

from __future__ import annotations

import argparse
import functools
import time

import numpy as np

from _common import header, policy_worker, first_batch_prompts, preload_allocator, set_all_threads, verdict
from limits import cpu_kind, grpo_advantages, matmul_gflops, model_dims, update_flops

TARGET_MFU = 0.50

#: Operator-name fragments of each group in the profile (first match wins; the rest is "other").
GROUPS = (("matmul", ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "mkldnn_linear")),
          ("attention", ("scaled_dot_product",)),
          ("optimizer kernel", ("_fused_adamw", "_fused_adam")),
          ("oneDNN weight packing", ("_reorder_linear_weight",)),
          ("casts and copies", ("aten::copy_",)),
          ("cat", ("aten::cat",)),
          ("zero fills", ("aten::fill_", "aten::zero_")),
          ("gradient norm", ("linalg_vector_norm",)))


def group_of(name: str) -> str:
    for group, keys in GROUPS:
        if any(k in name for k in keys):
            return group
    return "other (elementwise, indexing, ...)"


def _operands(name: str, shapes: list, dtype) -> tuple | None:
    """Random contiguous operands for one profiled matmul call, or None for a call shape not handled."""
    import torch

    def rand(shape):
        return torch.randn(*shape, dtype=dtype)

    shapes = [list(x) for x in shapes if isinstance(x, (list, tuple))]
    if name == "aten::mm" and len(shapes) >= 2 and len(shapes[0]) == len(shapes[1]) == 2:
        return torch.mm, (rand(shapes[0]), rand(shapes[1]))
    if name == "aten::bmm" and len(shapes) >= 2 and len(shapes[0]) == len(shapes[1]) == 3:
        return torch.bmm, (rand(shapes[0]), rand(shapes[1]))
    if name == "aten::addmm" and len(shapes) >= 3 and len(shapes[1]) == len(shapes[2]) == 2:
        return torch.addmm, (rand(shapes[0]), rand(shapes[1]), rand(shapes[2]))
    return None


def matmul_only_seconds(events, dtype, repeats: int) -> tuple[float, float, int]:
    """``(seconds, profiled seconds of the calls not timed, calls timed)``: every matmul call of the
    profiled update run alone on contiguous operands in ``dtype``, best of ``repeats`` per shape, times
    its count. Calls of a kind not handled here count at their profiled time."""
    total, untimed, calls = 0.0, 0.0, 0
    for e in events:
        if group_of(e.key) != "matmul":
            continue
        op = _operands(e.key, e.input_shapes, dtype)
        if op is None:
            untimed += e.self_cpu_time_total / 1e6
            continue
        fn, args = op
        fn(*args)
        best = float("inf")
        for _ in range(max(3, repeats)):
            t = time.perf_counter()
            fn(*args)
            best = min(best, time.perf_counter() - t)
        total += best * e.count
        calls += e.count
    return total + untimed, untimed, calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--matmul-n", type=int, default=2048)
    ap.add_argument("--rows", type=int, default=25, help="top operators listed")
    ap.add_argument("--allocator", default="auto")
    args = ap.parse_args()
    print(f"allocator: {preload_allocator(args.allocator)}", flush=True)
    import torch
    from torch.profiler import ProfilerActivity, profile

    from trajflow.config import load_config
    from trajflow.modeling.packing import micro_batch_plan
    from trajflow.stages.policy_update import UpdateBatch, UpdateRows, UpdateSettings
    from trajflow.stages.rollout import SamplingParams
    from trajflow.stages.scorers import reasoning_gym_scorer

    threads = set_all_threads()
    cfg = load_config(None, [f"rollout.max_new_tokens={args.max_new_tokens}"])
    print(f"CPU: {cpu_kind()}; torch {torch.__version__}, {threads} threads")
    worker = policy_worker(cfg)
    worker.release_memory = False  # what resources.release_memory=auto resolves to with no other model worker
    dtype = worker.param_dtype
    n = cfg.rollout.n
    prompts, prompt_ids = first_batch_prompts(cfg, worker)
    gen = worker.generate_sequences(prompt_ids, SamplingParams(n=n, temperature=cfg.rollout.temperature, top_p=1.0,
                                                               top_k=0, max_new_tokens=args.max_new_tokens, seed=1000),
                                    False)
    rows_prompt = [p for p in prompt_ids for _ in range(n)]
    resp = gen.response_ids
    scores = np.array([reasoning_gym_scorer(p.data_source, text, str(p.ground_truth), p.extra_info)["score"]
                       for p, text in zip([p for p in prompts for _ in range(n)], gen.response_text)])
    old = worker.compute_log_prob(rows_prompt, resp, cfg.rollout.temperature)
    batch = UpdateBatch(UpdateRows(rows_prompt, resp, [o.tolist() for o in old],
                                   [[float(a)] * len(r) for a, r in zip(grpo_advantages(scores, n), resp)]),
                        UpdateSettings(mini_batch_rows=cfg.actor.ppo_mini_batch_size * n, shuffle_seed=0))
    budget = int(worker.actor.ppo_max_token_len_per_gpu) if worker.actor.use_dynamic_bsz else None
    plan = micro_batch_plan(rows_prompt, resp, int(worker.actor.ppo_micro_batch_size), budget)
    F, _, parts = update_flops(model_dims(worker.model), rows_prompt, [len(r) for r in resp], plan)
    print(f"{len(resp)} rows, {sum(len(r) for r in resp)} response tokens, {len(plan)} micro-batch(es); "
          f"{parts['t_all']:.0f} tokens computed; {F / 1e12:.3f} TFLOP (body {parts['body'] / 1e12:.3f}, "
          f"LM head {parts['head'] / 1e12:.3f}, attention {parts['attn'] / 1e12:.3f}); compute dtype {dtype}")

    header(f"1. matmul ceiling ({dtype} {args.matmul_n}^3)")
    tdtype = getattr(torch, dtype)
    peak, rates = matmul_gflops(args.matmul_n, max(3, args.repeats * 3), tdtype)
    print(f"{', '.join(f'{r:.0f}' for r in rates)} GFLOP/s")

    phases: dict[str, float] = {}

    def timed(name, fn):
        @functools.wraps(fn)
        def inner(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                phases[name] = phases.get(name, 0.0) + time.perf_counter() - t
        return inner

    backend = worker.backend
    backend.forward = timed("forward", backend.forward)
    backend.backward = timed("backward", backend.backward)
    backend.step = timed("optimizer step (norm, clip, AdamW)", backend.step)
    worker._push_weights = timed("weight push to the rollout copy", worker._push_weights)

    header("2. updates and their phases (wall seconds)")
    runs = []
    for r in range(1 + args.repeats):
        phases.clear()
        t = time.perf_counter()
        m = worker.update_actor(batch)
        dt = time.perf_counter() - t
        phases["rest (packing, losses, metrics)"] = dt - sum(phases.values())
        print(f"update {'(warm-up) ' if r == 0 else ''}{dt:.2f} s: " + ", ".join(f"{k} {v:.2f}" for k, v in phases.items())
              + f"; grad_norm {m.get('actor/grad_norm', float('nan')):.3f}", flush=True)
        if r:
            runs.append((dt, dict(phases)))
    peak2, rates2 = matmul_gflops(args.matmul_n, max(3, args.repeats * 3), tdtype)
    print(f"{dtype} matmul again: {', '.join(f'{r:.0f}' for r in rates2)} GFLOP/s")
    peak = max(peak, peak2)
    best, best_phases = min(runs, key=lambda x: x[0])
    mfu = F / best / 1e9 / peak
    print(f"best update {best:.2f} s (median {np.median([x[0] for x in runs]):.2f}) -> {F / best / 1e9:.0f} GFLOP/s "
          f"= MFU {mfu:.1%} of {peak:.0f} GFLOP/s")
    for k, v in best_phases.items():
        print(f"  {k:40s} {v:6.2f} s  {v / best:6.1%}")

    header("3. operators of one more update (torch.profiler, wall self time)")
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True, with_flops=True) as prof:
        worker.update_actor(batch)
    events = [e for e in prof.key_averages(group_by_input_shape=True) if e.self_cpu_time_total > 0]
    total = sum(e.self_cpu_time_total for e in events) / 1e6
    groups: dict[str, list[float]] = {}
    for e in events:
        g = groups.setdefault(group_of(e.key), [0.0, 0])
        g[0] += e.self_cpu_time_total / 1e6
        g[1] += e.count
    mm_flops = sum(e.flops for e in events if group_of(e.key) == "matmul" and getattr(e, "flops", 0))
    print(f"profiled update: {total:.2f} s of operator self time")
    for name, (s, c) in sorted(groups.items(), key=lambda kv: -kv[1][0]):
        print(f"  {name:36s} {s:6.2f} s  {s / total:6.1%}  ({c} calls)")
    if groups.get("matmul") and mm_flops:
        rate = mm_flops / groups["matmul"][0] / 1e9
        print(f"matmuls (no attention) run at {rate:.0f} GFLOP/s = {rate / peak:.0%} of the square-matmul ceiling")
    print(f"top {args.rows} operators by self time:")
    for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:args.rows]:
        print(f"  {e.self_cpu_time_total / 1e6:6.3f} s {e.count:5d}x  {e.key[:48]:48s} {str(e.input_shapes)[:90]}")

    header("4. the matmul-only bound (each matmul of that update alone, contiguous operands)")
    mm_s, untimed, calls = matmul_only_seconds(events, tdtype, args.repeats * 3)
    bound = F / mm_s / 1e9 / peak
    print(f"{calls} matmul calls timed alone: {mm_s:.2f} s ({untimed:.2f} s of it at profiled time, not timed); "
          f"the update's {F / 1e12:.3f} TFLOP in that time = MFU {bound:.1%} (measured {mfu:.1%}): the highest this "
          f"update reaches with every other operator free")

    header("targets")
    verdict(f"update MFU, {dtype} compute (fraction of the {dtype} matmul ceiling)", mfu, TARGET_MFU, fmt="{:.1%}")


if __name__ == "__main__":
    main()
