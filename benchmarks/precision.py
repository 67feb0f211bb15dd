"""Mixed precision vs fp32, side by side in one process: the default recipe's policy update, and
generation tokens/s at batch 32 with a bf16 sampler vs the fp32 module.

One policy worker of the default recipe (fp32 master weights) and one batch: the recipe's
``basic_arithmetic`` prompts x samples (8 x 8) and response cap (64 new tokens) at temperature 1,
sampled once from the untrained policy.
The update (``update_actor``: forward, backward, AdamW step, one micro-batch under the 2048-token
budget) alternates between fp32 compute and bf16 autocast compute on the same worker, so both see the
same machine load; generation alternates between the fp32 module itself and the engine's bf16 copy
(``rollout.dtype=bfloat16``) over the same 32 rows. Best of the timed repeats after one warm-up
each (on a shared machine a repeat is only ever slowed down by others' load, never sped up; the
medians are printed too); targets from issue 20 (>= 2x each). ``bf16 fast`` says whether this CPU has AMX/AVX512-BF16:
without it bf16 is emulated and both ratios are expected below 1.

    .venv/bin/python benchmarks/precision.py            # 3 timed repeats of each
    .venv/bin/python benchmarks/precision.py --quick    # 1 timed repeat
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from _common import header, median, preload_allocator, set_all_threads, verdict

TARGET = 2.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1 timed repeat of each")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model", default=None, help="model.path (default: the default recipe's model)")
    args = ap.parse_args()
    repeats = 1 if args.quick else args.repeats
    alloc = preload_allocator()

    import numpy as np
    from omegaconf import OmegaConf

    from trajflow.stages.policy_update import UpdateBatch, UpdateRows, UpdateSettings
    from trajflow.stages.rollout import SamplingParams
    from trajflow.config import load_config
    from trajflow.engines.hf import HFRolloutEngine, generated_token_count
    from trajflow.modeling.precision import bf16_is_fast
    from trajflow.models import resolve_model_path
    from trajflow.prompts.loading import load_prompt_dataset
    from trajflow.workers.policy import PolicyWorker

    over = ["actor.mixed_precision.param_dtype=float32", "rollout.dtype=float32"]
    cfg = load_config(None, over + ([f"model.path={args.model}"] if args.model else []))
    path = str(resolve_model_path(cfg.model.path, cfg.model.cache_dir))
    model_cfg, actor, rollout = (OmegaConf.to_object(cfg[k]) for k in ("model", "actor", "rollout"))
    threads = set_all_threads()
    worker = PolicyWorker(path, actor, model_cfg, rollout, seed=42, num_threads=threads)
    # What the default recipe's resources.release_memory=auto resolves to (no other model worker).
    worker.release_memory = False
    data = load_prompt_dataset(cfg.data.dataset)
    prompts = worker.tokenize_prompts([p.messages for p in data.train[:cfg.data.train_batch_size]],
                                      cfg.data.max_prompt_length)
    n, T = int(cfg.rollout.n), int(cfg.rollout.max_new_tokens)
    params = SamplingParams(n=n, temperature=1.0, max_new_tokens=T, seed=7)

    fast, why = bf16_is_fast("cpu")
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), "unknown CPU")
    header("mixed precision (bf16 compute, fp32 master weights) vs fp32")
    print(f"CPU: {cpu}; bf16 fast: {fast} ({why}); allocator: {alloc}; {threads} torch threads; "
          f"{repeats} timed repeat(s) after 1 warm-up", flush=True)

    # ---- generation: the fp32 module vs the engine's own bf16 copy, same 32 rows
    engines = {"float32": HFRolloutEngine(worker.model, worker.pad_id, worker.eos_ids, 32, "cpu"),
               "bfloat16": HFRolloutEngine(worker.model, worker.pad_id, worker.eos_ids, 32, "cpu", dtype="bfloat16")}
    gen: dict[str, list[float]] = {k: [] for k in engines}
    for i in range(repeats + 1):
        for name, eng in engines.items():
            t0 = time.perf_counter()
            out = eng.generate(prompts, params)
            dt = time.perf_counter() - t0
            if i:
                gen[name].append(generated_token_count(out) / dt)
            print(f"  generation {name}{' (warm-up)' if not i else ''}: {generated_token_count(out)} tokens in "
                  f"{dt:.2f} s", flush=True)
    out = worker.generate_sequences(prompts, params)
    del engines

    # ---- update: the same batch, fp32 compute vs bf16 autocast, alternating on one worker
    rows = [p for p in prompts for _ in range(n)]
    sign = np.random.default_rng(0).choice([-1.0, 1.0], size=len(rows))
    adv = [[float(s)] * len(r) for s, r in zip(sign, out.response_ids)]
    batch = UpdateBatch(UpdateRows(rows, out.response_ids, out.rollout_logprobs, adv), UpdateSettings(len(rows)))
    upd: dict[str, list[float]] = {"float32": [], "bfloat16": []}
    for i in range(repeats + 1):
        for dtype in upd:
            worker.backend.param_dtype = worker.param_dtype = dtype
            t0 = time.perf_counter()
            worker.update_actor(batch)
            dt = time.perf_counter() - t0
            if i:
                upd[dtype].append(dt)
            print(f"  update {dtype}{' (warm-up)' if not i else ''}: {dt:.2f} s", flush=True)

    tokens = sum(len(r) for r in out.response_ids)
    print(f"batch: {len(rows)} rows ({cfg.data.train_batch_size} prompts x {n}), {tokens} response tokens, "
          f"up to {T} new tokens", flush=True)
    u32, u16 = min(upd["float32"]), min(upd["bfloat16"])
    g32, g16 = max(gen["float32"]), max(gen["bfloat16"])
    m = {k: median(v) for k, v in {**{f"u{k}": x for k, x in upd.items()}, **{f"g{k}": x for k, x in gen.items()}}.items()}
    print(f"{'':<30}{'fp32':>10}{'bf16':>10}{'ratio':>8}", flush=True)
    print(f"{'update s (best)':<30}{u32:>10.2f}{u16:>10.2f}{u32 / u16:>7.2f}x", flush=True)
    print(f"{'generation tok/s b=32 (best)':<30}{g32:>10.1f}{g16:>10.1f}{g16 / g32:>7.2f}x", flush=True)
    print(f"{'update s (median)':<30}{m['ufloat32']:>10.2f}{m['ubfloat16']:>10.2f}"
          f"{m['ufloat32'] / m['ubfloat16']:>7.2f}x", flush=True)
    print(f"{'generation tok/s (median)':<30}{m['gfloat32']:>10.1f}{m['gbfloat16']:>10.1f}"
          f"{m['gbfloat16'] / m['gfloat32']:>7.2f}x", flush=True)
    print("all update s: fp32 " + ", ".join(f"{x:.2f}" for x in upd["float32"]) + "; bf16 "
          + ", ".join(f"{x:.2f}" for x in upd["bfloat16"]), flush=True)
    print("all tok/s: fp32 " + ", ".join(f"{x:.1f}" for x in gen["float32"]) + "; bf16 "
          + ", ".join(f"{x:.1f}" for x in gen["bfloat16"]), flush=True)
    verdict("update speed-up, mixed bf16 vs fp32", u32 / u16, TARGET, fmt="{:.2f}")
    verdict("generation speed-up at batch 32, bf16 rollout vs fp32", g16 / g32, TARGET, fmt="{:.2f}")


if __name__ == "__main__":
    main()
