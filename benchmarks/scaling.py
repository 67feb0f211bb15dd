"""Policy-update throughput with 1 and 2 data-parallel ranks (DeepSpeed over gloo, CPU).

Builds a small random Llama with SmolLM2's tokenizer, a synthetic PPO batch, and times
``update_actor`` (after one warm-up update) for: the single-process worker (``actor.strategy=none``),
DeepSpeed with 1 rank and DeepSpeed with 2 ranks (ZeRO stage from ``--zero-stage``). Every variant
gets the same total CPU threads (``--threads``, split evenly across ranks), so the numbers show what
data parallelism buys on the same cores. Also prints DeepSpeed's start-up time per rank.

    python benchmarks/scaling.py [--rows 32] [--prompt-len 48] [--response-len 48] [--updates 3]
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


def make_model(out: Path, hidden: int, layers: int) -> Path:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from trajflow.models import builtin_tokenizer_dir

    tok = AutoTokenizer.from_pretrained(builtin_tokenizer_dir("smollm2-135m-instruct"))
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=hidden * 4, num_hidden_layers=layers,
                      num_attention_heads=max(1, hidden // 64), num_key_value_heads=max(1, hidden // 128),
                      max_position_embeddings=1024, tie_word_embeddings=True, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    LlamaForCausalLM(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def make_batch(rows: int, prompt_len: int, response_len: int, seed: int = 0):
    import numpy as np

    from trajflow.stages.policy_update import UpdateBatch, UpdateRows, UpdateSettings

    rng = np.random.default_rng(seed)
    prompts = [rng.integers(10, 40000, size=int(rng.integers(prompt_len // 2, prompt_len + 1))).tolist()
               for _ in range(rows)]
    resps = [rng.integers(10, 40000, size=int(rng.integers(response_len // 2, response_len + 1))).tolist()
             for _ in range(rows)]
    old = [[-10.0] * len(r) for r in resps]  # off-policy enough to exercise clipping
    return UpdateBatch(UpdateRows(prompts, resps, old, [[float(rng.normal())] * len(r) for r in resps]),
                       UpdateSettings(mini_batch_rows=rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=48)
    ap.add_argument("--response-len", type=int, default=48)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--updates", type=int, default=3)
    ap.add_argument("--zero-stage", type=int, default=2)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    args = ap.parse_args()

    import ray

    from trajflow.config import ActorConfig, ModelConfig, RolloutConfig
    from trajflow.workers.group import WorkerGroup
    from trajflow.workers.policy import PolicyWorker

    model_dir = make_model(Path(tempfile.mkdtemp(prefix="trajflow-scaling-")), args.hidden, args.layers)
    batch = make_batch(args.rows, args.prompt_len, args.response_len)
    tokens = sum(len(p) + len(r) for p, r in zip(batch.rows.prompt_ids, batch.rows.response_ids))
    actor = dict(lr=1e-5, betas=[0.9, 0.999], weight_decay=0.0, ppo_micro_batch_size=args.micro_batch, ppo_epochs=1,
                 shuffle=False, policy_loss="vanilla", clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.2,
                 clip_ratio_c=3.0, loss_agg_mode="token-mean", entropy_coeff=0.0, kl_loss_coef=0.0,
                 kl_loss_type="low_var_kl", grad_clip=1.0)
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
    print(f"model: Llama hidden={args.hidden} layers={args.layers} vocab=49152; batch {args.rows} rows, "
          f"{tokens} tokens (prompt+response), micro-batch {args.micro_batch}; {args.threads} CPU threads in total")
    print(f"{'variant':32s} {'start-up s':>10s} {'update s':>9s} {'tokens/s':>9s}")
    results = {}
    for name, strategy, world in (("one process (strategy=none)", "none", 1),
                                  (f"DeepSpeed ZeRO-{args.zero_stage}, 1 rank", "deepspeed", 1),
                                  (f"DeepSpeed ZeRO-{args.zero_stage}, 2 ranks", "deepspeed", 2)):
        a = {**actor, "strategy": strategy, "zero_stage": args.zero_stage if strategy == "deepspeed" else 0,
             "world_size": world}
        threads = max(1, args.threads // world)
        t0 = time.perf_counter()
        group = WorkerGroup.spawn(PolicyWorker, (str(model_dir), ActorConfig(**a), ModelConfig(dtype="float32"),
                                                 RolloutConfig(micro_batch_size=8, temperature=1.0), 0, "cpu", threads),
                                  [{"num_cpus": 0}] * world, "actor")
        ray.get(group.info.remote())
        init = group.init_distributed() if strategy == "deepspeed" else []
        startup = time.perf_counter() - t0
        group.execute("update_actor", batch)  # warm-up
        times = []
        for _ in range(args.updates):
            t = time.perf_counter()
            group.execute("update_actor", batch)
            times.append(time.perf_counter() - t)
        group.kill()
        med = statistics.median(times)
        results[name] = tokens / med
        ds_init = f" (deepspeed.initialize {max(r['init_s'] for r in init):.1f} s)" if init else ""
        print(f"{name:32s} {startup:10.1f} {med:9.2f} {tokens / med:9.1f}{ds_init}")
    names = list(results)
    print(f"speed-up 2 ranks vs 1 rank (DeepSpeed): {results[names[2]] / results[names[1]]:.2f}x; "
          f"DeepSpeed 1 rank vs one process: {results[names[1]] / results[names[0]]:.2f}x")
    ray.shutdown()


if __name__ == "__main__":
    main()
