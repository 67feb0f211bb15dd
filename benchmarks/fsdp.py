"""The policy update on 2 CPU ranks: FSDP2 vs DeepSpeed ZeRO-2 / ZeRO-3 vs one process.

Times ``update_actor`` on a batch shaped like the default recipe's (``grpo_default``: 8 prompts x 8
samples = 64 rows, responses up to 64 tokens, micro-batches of 8 rows), after one warm-up update,
and reads each rank's peak resident memory during the timed updates (``VmHWM`` after resetting it
through ``/proc/self/clear_refs``). Variants: the one-process worker (all threads in one process),
DeepSpeed ZeRO-2 and ZeRO-3 on 2 ranks, FSDP2 on 2 ranks as configured by default
(``reshard_after_forward``), with the parameters kept gathered from forward to backward, with CPU
offload (``actor.fsdp.offload_params``) and with activation checkpointing
(``model.gradient_checkpointing``). Every variant gets the same CPU threads in total (split
evenly across ranks). The model is a random Llama with SmolLM2's tokenizer (``--hidden``,
``--layers``); ``--model PATH`` takes a Hugging Face directory instead (e.g. the default recipe's
SmolLM2-135M saved with ``save_pretrained``).

Prints one table; PASS when every 2-rank variant finished and FSDP2's update is within
``--max-ratio`` of DeepSpeed ZeRO-3's time (the two shard the same things), else MISS.

    python benchmarks/fsdp.py [--updates 2] [--hidden 256] [--layers 4] [--model PATH] [--device cuda]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trajflow.infra.env import configure_environment  # noqa: E402

configure_environment()


def default_recipe_batch(prompts: int = 8, n: int = 8, prompt_len: int = 96, response_len: int = 64, seed: int = 0):
    """``prompts`` x ``n`` rows (each prompt repeated ``n`` times, as a GRPO group), random token ids,
    responses of 16..``response_len`` tokens, off-policy old log-probs (clipping is exercised)."""
    import numpy as np

    from trajflow.stages.policy_update import UpdateBatch, UpdateRows, UpdateSettings

    rng = np.random.default_rng(seed)
    ps = [rng.integers(10, 40000, size=int(rng.integers(prompt_len // 2, prompt_len + 1))).tolist()
          for _ in range(prompts)]
    rows_p = [p for p in ps for _ in range(n)]
    resps = [rng.integers(10, 40000, size=int(rng.integers(16, response_len + 1))).tolist() for _ in rows_p]
    old = [[-10.0] * len(r) for r in resps]
    adv = [[float(rng.normal())] * len(r) for r in resps]
    return UpdateBatch(UpdateRows(rows_p, resps, old, adv), UpdateSettings(mini_batch_rows=len(rows_p)))


def measured_worker():
    """The policy worker plus two calls that read this process's peak resident memory."""
    from trajflow.workers.group import dispatch
    from trajflow.workers.policy import PolicyWorker

    class MeasuredPolicyWorker(PolicyWorker):
        @dispatch("gather")
        def reset_peak_rss(self) -> bool:
            try:
                Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM (Linux >= 4.0)
                return True
            except OSError:
                return False

        @dispatch("gather")
        def peak_rss_gib(self) -> float:
            for line in Path("/proc/self/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 2**20
            return float("nan")

    return MeasuredPolicyWorker


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a Hugging Face model directory (default: a random Llama)")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--updates", type=int, default=2)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--max-ratio", type=float, default=1.5, help="FSDP2 / ZeRO-3 update time that still PASSes")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="one GPU per rank with cuda (NCCL)")
    ap.add_argument("--only", default=None, help="comma-separated variant numbers to run (1-based)")
    args = ap.parse_args()

    import ray
    from omegaconf import OmegaConf

    from benchmarks.scaling import make_model
    from trajflow.config import ActorConfig, ModelConfig, RolloutConfig
    from trajflow.workers.group import WorkerGroup

    model_dir = Path(args.model) if args.model else make_model(
        Path(tempfile.mkdtemp(prefix="trajflow-fsdp-bench-")), args.hidden, args.layers)
    batch = default_recipe_batch()
    tokens = sum(len(p) + len(r) for p, r in zip(batch.rows.prompt_ids, batch.rows.response_ids))
    actor = dict(lr=1e-5, ppo_micro_batch_size=args.micro_batch, clip_ratio_low=0.2, clip_ratio_high=0.28,
                 kl_loss_coef=0.0, grad_clip=1.0)
    variants = [
        ("one process", dict(strategy="none", world_size=1), {}),
        ("DeepSpeed ZeRO-2", dict(strategy="deepspeed", zero_stage=2, world_size=2), {}),
        ("DeepSpeed ZeRO-3", dict(strategy="deepspeed", zero_stage=3, world_size=2), {}),
        ("FSDP2", dict(strategy="fsdp2", world_size=2), {}),
        ("FSDP2, no reshard after fwd", dict(strategy="fsdp2", world_size=2, fsdp={"reshard_after_forward": False}), {}),
        ("FSDP2 + CPU offload", dict(strategy="fsdp2", world_size=2, fsdp={"offload_params": True}), {}),
        ("FSDP2 + act. checkpointing", dict(strategy="fsdp2", world_size=2), {"gradient_checkpointing": True}),
    ]
    if args.only:
        keep = {int(i) for i in args.only.split(",")}
        variants = [v for i, v in enumerate(variants, 1) if i in keep]
    import platform

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    ray.init(num_cpus=max(2, os.cpu_count() or 2), include_dashboard=False, log_to_driver=False)
    print(f"CPU: {cpu}; {os.cpu_count()} CPUs, {args.threads} torch threads in total per variant; "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"model: {model_dir if args.model else f'random Llama hidden={args.hidden} layers={args.layers}'}; batch "
          f"{len(batch.rows.prompt_ids)} rows (8 prompts x 8), {tokens} tokens, micro-batch {args.micro_batch}")
    print(f"{'variant':30s} {'ranks':>5s} {'start s':>8s} {'update s':>9s} {'peak RSS GiB/rank':>20s}")
    worker_cls = measured_worker()
    results: dict[str, float] = {}
    for name, a, m in variants:
        cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ActorConfig), {**actor, **a}))
        world = int(cfg.world_size)
        t0 = time.perf_counter()
        group = WorkerGroup.spawn(worker_cls, (str(model_dir), cfg, ModelConfig(dtype="float32", **m),
                                               RolloutConfig(micro_batch_size=8, temperature=1.0), 0, args.device,
                                               max(1, args.threads // world)),
                                  [{"num_cpus": 0, **({"num_gpus": 1} if args.device == "cuda" else {})}] * world,
                                  "actor", lockstep=a["strategy"] != "none")
        try:
            ray.get(group.info.remote())
            if a["strategy"] != "none":
                group.init_distributed()
            startup = time.perf_counter() - t0
            group.execute("update_actor", batch)  # warm-up
            group.execute("reset_peak_rss")
            times = []
            for _ in range(args.updates):
                t = time.perf_counter()
                group.execute("update_actor", batch)
                times.append(time.perf_counter() - t)
            peaks = group.execute("peak_rss_gib")
            peaks = peaks if isinstance(peaks, list) else [peaks]  # one rank: the actor's own answer
        finally:
            group.kill()
        results[name] = statistics.median(times)
        print(f"{name:30s} {world:5d} {startup:8.1f} {results[name]:9.2f} "
              f"{' / '.join(f'{p:.2f}' for p in peaks):>20s}", flush=True)
    ray.shutdown()
    if "FSDP2" in results and "DeepSpeed ZeRO-3" in results:
        ratio = results["FSDP2"] / results["DeepSpeed ZeRO-3"]
        verdict = "PASS" if ratio <= args.max_ratio else "MISS"
        print(f"{verdict}: FSDP2 update {results['FSDP2']:.2f} s = {ratio:.2f}x DeepSpeed ZeRO-3's "
              f"(limit {args.max_ratio}x)")


if __name__ == "__main__":
    main()
