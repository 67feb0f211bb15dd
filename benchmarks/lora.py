"""Full fine-tuning vs LoRA (Hu et al. 2021, via peft) on the policy worker: peak RSS, update time,
checkpoint size and save time.

Each setting runs in its own process (``--one``), so its peak RSS (``ru_maxrss``: model, gradients,
optimizer state, activations, the rollout's KV cache) is its own. Every setting trains on the same
batch: the default recipe's shape (8 prompts x 4 samples, ``basic_arithmetic`` prompts, up to 32
new tokens at temperature 1, one micro-batch under the 2048-token budget), sampled once per process
with the same seed from the untrained policy (LoRA's ``B`` starts at 0, so the adapted model samples
exactly what the base does). An update is one ``update_actor`` call (forward, backward, AdamW step);
the checkpoint is ``save_checkpoint`` (full: the weights and AdamW state; LoRA: the adapter and its
AdamW state).

    .venv/bin/python benchmarks/lora.py                 # SmolLM2-135M-Instruct, 1 warm-up + 3 timed updates
    .venv/bin/python benchmarks/lora.py --quick         # 1 timed update
    .venv/bin/python benchmarks/lora.py --model DIR     # another Hugging Face directory
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import GIB, REPO, header, median, preload_allocator, set_all_threads  # noqa: F401

SETTINGS = {"full": 0, "lora16": 16, "lora32": 32}


def _one(setting: str, model: str | None, updates: int) -> dict:
    import numpy as np

    from trajflow.stages.policy_update import UpdateBatch, UpdateRows, UpdateSettings
    from trajflow.stages.rollout import SamplingParams
    from omegaconf import OmegaConf

    from trajflow.config import load_config
    from trajflow.models import resolve_model_path
    from trajflow.prompts.loading import load_prompt_dataset
    from trajflow.workers.policy import PolicyWorker

    recipe = "grpo_lora" if SETTINGS[setting] else None
    cfg = load_config(recipe, [f"model.lora_rank={SETTINGS[setting]}"] + ([f"model.path={model}"] if model else []))
    path = str(resolve_model_path(cfg.model.path, cfg.model.cache_dir))
    model_cfg, actor, rollout = (OmegaConf.to_object(cfg[k]) for k in ("model", "actor", "rollout"))
    threads = set_all_threads()
    worker = PolicyWorker(path, actor, model_cfg, rollout, seed=42, num_threads=threads)
    data = load_prompt_dataset(cfg.data.dataset)
    messages = [p.messages for p in data.train[:cfg.data.train_batch_size]]
    prompts = worker.tokenize_prompts(messages, cfg.data.max_prompt_length)
    n = int(cfg.rollout.n)
    out = worker.generate_sequences(prompts, SamplingParams(n=n, temperature=1.0, max_new_tokens=32, seed=7))
    rows = [p for p in prompts for _ in range(n)]
    sign = np.random.default_rng(0).choice([-1.0, 1.0], size=len(rows))
    adv = [[float(s)] * len(r) for s, r in zip(sign, out.response_ids)]
    batch = UpdateBatch(UpdateRows(rows, out.response_ids, out.rollout_logprobs, adv), UpdateSettings(len(rows)))
    times = []
    for i in range(updates + 1):  # the first is a warm-up (allocator, lazy optimizer state)
        t0 = time.perf_counter()
        worker.update_actor(batch)
        if i:
            times.append(time.perf_counter() - t0)
    with tempfile.TemporaryDirectory(prefix="trajflow-bench-lora-") as tmp:
        t0 = time.perf_counter()
        worker.save_checkpoint(str(Path(tmp) / "actor"))
        save_s = time.perf_counter() - t0
        ckpt_bytes = sum(p.stat().st_size for p in Path(tmp).rglob("*") if p.is_file())
    info = worker.info()
    return {"setting": setting, "update_s": median(times), "updates": len(times),
            "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB,
            "ckpt_mib": ckpt_bytes / 2**20, "save_s": save_s, "trainable": info["trainable_params"],
            "params": info["num_params"], "tokens": sum(len(r) for r in out.response_ids), "threads": threads}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1 timed update per setting")
    ap.add_argument("--updates", type=int, default=3)
    ap.add_argument("--model", default=None, help="model.path (default: the default recipe's model)")
    ap.add_argument("--one", choices=sorted(SETTINGS), help=argparse.SUPPRESS)
    args = ap.parse_args()
    updates = 1 if args.quick else args.updates
    if args.one:
        print(json.dumps(_one(args.one, args.model, updates)))
        return
    alloc = preload_allocator()
    header("full fine-tuning vs LoRA: one policy update, peak RSS, checkpoint")
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), "unknown CPU")
    print(f"CPU: {cpu}; allocator: {alloc}; {updates} timed update(s) after 1 warm-up", flush=True)
    print(f"{'setting':<8} {'trainable':>12} {'update s':>9} {'peak RSS GiB':>13} {'ckpt MiB':>9} {'save s':>7}",
          flush=True)
    for setting in SETTINGS:
        cmd = [sys.executable, str(Path(__file__)), "--one", setting, "--updates", str(updates)]
        if args.model:
            cmd += ["--model", args.model]
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
        if done.returncode:
            sys.exit(f"{setting} failed:\n{done.stderr[-3000:]}")
        r = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"{r['setting']:<8} {r['trainable'] / 1e6:>11.2f}M {r['update_s']:>9.2f} {r['peak_rss_gib']:>13.2f} "
              f"{r['ckpt_mib']:>9.1f} {r['save_s']:>7.2f}   ({r['tokens']} response tokens, "
              f"{r['params'] / 1e6:.1f}M parameters, {r['threads']} torch threads)", flush=True)


if __name__ == "__main__":
    main()
