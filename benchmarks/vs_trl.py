"""trajflow vs TRL's GRPOTrainer, side by side in one process, on the same model, prompts and settings.

Both trainers run one after the other in this script (trajflow first, then TRL), so their ratio is
measured under the same machine load; absolute seconds on a shared machine move from run to run,
the ratio much less.

Settings shared by both (the default recipe with 64 new tokens):
  model SmolLM2-135M-Instruct (sdpa; fp32 weights) in one precision on both sides (``--precision``:
  ``fp32``, or ``bf16``: trajflow's mixed policy, bf16 compute over fp32 master weights with a bf16
  sampler, against TRL's ``bf16=True``, the Trainer's bf16 autocast on CPU; ``auto``, the default,
  is bf16 where this CPU has AMX/AVX512-BF16, else fp32), prompts of trajflow's ``basic_arithmetic`` dataset in the
  order trajflow's PromptSampler draws them (seed 42); the recipe's prompts x samples (8 x 8 = 64
  completions) per iteration; 64 new tokens; temperature 1.0, top_p 1.0, top_k off; one PPO epoch, one optimizer step per
  iteration, the recipe's micro-batches (a 2048-token budget: the whole batch in one micro-batch; TRL,
  which has no token budget, gets ``per_device_train_batch_size`` = all rows); clip 0.2; token-mean loss (TRL: ``loss_type="dapo"``);
  GRPO advantages normalised by the group std; no KL term (no reference model); AdamW lr 1e-5,
  constant; grad clip 1.0; no gradient checkpointing; reward = ``trajflow.stages.scorers.reasoning_gym_scorer``
  (format bonus 0.1); torch threads = all CPUs. 1 warm-up iteration, then K timed ones.

What is compared ("s/iter"): the wall time of a whole iteration, steady state.
  * trajflow: from the end of iteration i-1's bookkeeping to the end of iteration i's (rollout,
    reward, gate, advantage, update, Prefect/Ray/Parquet/manifest/MLflow), checkpoint saves excluded
    (``trainer.save_freq=0``: none is written). ``timing_s/step`` is shown too.
  * TRL: between consecutive ``on_step_end`` callbacks (one optimizer step = one generation of all
    completions + its micro-batches' forward/backward passes + logging of the previous step).
Ratio = median TRL s/iter / median trajflow s/iter over the K warm iterations (> 1: trajflow faster).

With one PPO epoch and one optimizer step per generation TRL skips the old-log-prob forward (the
ratio is 1 by construction); the script prints trajflow's ``timing_s/old_log_prob`` (0 when trajflow
takes the rollout log-probs from generation, as it does on main since the on-policy fast path).

    .venv/bin/python benchmarks/vs_trl.py [--iterations K] [--max-new-tokens 64] [--quick] [--only trl|trajflow]

Needs the ``bench`` extra (``pip install -e '.[bench]'``: TRL); never part of the default install.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import time
from pathlib import Path

from _common import header, median, preload_allocator, run_trajflow, scratch_dir, set_all_threads, verdict

# Issue 20: the whole iteration >= 6x TRL's, each side in its fastest correct CPU configuration.
TARGET_RATIO = 6.0
SEED = 42


def shared_settings(args: argparse.Namespace) -> dict:
    from trajflow.config import load_config

    cfg = load_config(None, [f"rollout.max_new_tokens={args.max_new_tokens}"])
    s = dict(prompts=cfg.data.train_batch_size, n=cfg.rollout.n, max_new_tokens=cfg.rollout.max_new_tokens,
             temperature=cfg.rollout.temperature, lr=cfg.actor.lr,
             # TRL has no token budget: with the recipe's (which holds the whole batch at 64
             # new tokens) TRL gets its nearest equivalent, the whole batch in one micro-batch.
             micro=(cfg.data.train_batch_size * cfg.rollout.n if cfg.actor.use_dynamic_bsz
                    else cfg.actor.ppo_micro_batch_size),
             mini_prompts=cfg.actor.ppo_mini_batch_size, epochs=cfg.actor.ppo_epochs,
             clip=cfg.actor.clip_ratio_low if cfg.actor.clip_ratio_low is not None else cfg.actor.clip_ratio,
             clip_high=cfg.actor.clip_ratio_high if cfg.actor.clip_ratio_high is not None else cfg.actor.clip_ratio,
             grad_clip=cfg.actor.grad_clip,
             kl=cfg.actor.kl_loss_coef, agg=cfg.actor.loss_agg_mode, dataset=cfg.data.dataset, seed=cfg.trainer.seed,
             format_bonus=cfg.reward.format_bonus, norm_std=cfg.algorithm.norm_adv_by_std_in_grpo,
             iterations=1 + args.iterations, allocator=args.allocator, keep=args.keep,
             bf16=resolve_precision(args.precision) == "bf16")
    # The comparison is defined for one optimizer step per iteration, like TRL's default GRPO step.
    assert s["mini_prompts"] == s["prompts"] and s["epochs"] == 1 and s["kl"] == 0, s
    assert s["agg"] == "token-mean", s
    return s


def resolve_precision(choice: str) -> str:
    """``fp32`` or ``bf16`` for ``--precision`` (``auto``: bf16 where bf16 matmuls are fast on this CPU)."""
    if choice != "auto":
        return choice
    from trajflow.modeling.precision import bf16_is_fast

    return "bf16" if bf16_is_fast("cpu")[0] else "fp32"


# --------------------------------------------------------------------------------------------- trajflow


def run_trajflow_side(s: dict) -> dict:
    root = scratch_dir("bench-vs-trl-trajflow-", s["keep"])
    overrides = [f"rollout.max_new_tokens={s['max_new_tokens']}", f"trainer.total_iterations={s['iterations']}",
                 "trainer.test_freq=0", "trainer.save_freq=0", "trainer.progress=false",
                 f"resources.allocator={s['allocator']}"]
    dtype = "bfloat16" if s["bf16"] else "float32"
    overrides += [f"actor.mixed_precision.param_dtype={dtype}", f"rollout.dtype={dtype}"]
    print(f"trajflow: train(None, {overrides}) in {root}", flush=True)
    run = run_trajflow(overrides, root)
    rows = s["prompts"] * s["n"]
    gen_tokens = [m * rows for m in run.metrics["response_length/mean"]]
    per_it = []
    for i in range(s["iterations"]):
        per_it.append({"iteration": i + 1, "s_iter": run.cycle_s[i], "timing_s/step": run.metrics["timing_s/step"][i],
                       "gen_tokens": gen_tokens[i],
                       **{k: run.metrics.get(k, [math.nan] * s["iterations"])[i]
                          for k in ("timing_s/gen", "timing_s/old_log_prob", "timing_s/update_actor")}})
    return {"per_iteration": per_it, "wall_s": run.wall_s, "save_s": run.save_s}


# --------------------------------------------------------------------------------------------- TRL


def trl_dataset(s: dict):
    """TRL rows for exactly the prompts trajflow draws, in trajflow's order (PromptSampler, same seed)."""
    from datasets import Dataset

    from trajflow.prompts import PromptSampler, load_prompt_dataset

    ds = load_prompt_dataset(s["dataset"])
    sampler = PromptSampler(ds.train, s["prompts"], s["seed"])
    rows = []
    for _ in range(s["iterations"]):
        for p in sampler.next_batch():
            rows.append({"prompt": p.messages, "ground_truth": str(p.ground_truth), "data_source": p.data_source,
                         "extra_info": json.dumps(p.extra_info, default=str)})
    return Dataset.from_list(rows)


def make_reward_fn(format_bonus: float):
    from trajflow.stages.scorers import reasoning_gym_scorer

    def reasoning_gym_reward(prompts, completions, ground_truth, data_source, extra_info, **_):
        """TRL reward signature -> trajflow's reasoning-gym scorer (same scorer, same format bonus)."""
        out = []
        for c, gt, src, info in zip(completions, ground_truth, data_source, extra_info):
            text = c[-1]["content"] if isinstance(c, list) else str(c)
            out.append(float(reasoning_gym_scorer(src, text, gt, json.loads(info), format_bonus=format_bonus)["score"]))
        return out

    return reasoning_gym_reward


def run_trl_side(s: dict) -> dict:
    import torch
    import trl
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from trajflow.config import load_config
    from trajflow.models import load_causal_lm, load_tokenizer, resolve_model_path

    threads = set_all_threads()
    cfg = load_config(None, [])
    path = resolve_model_path(cfg.model.path, cfg.model.cache_dir)
    torch.manual_seed(SEED)
    model = load_causal_lm(path, cfg.model.dtype, "cpu", cfg.model.attn_implementation)
    tokenizer = load_tokenizer(path)
    rows = s["prompts"] * s["n"]
    out_dir = str(scratch_dir("bench-vs-trl-trl-", s["keep"]))
    args = GRPOConfig(
        output_dir=out_dir, use_cpu=True, bf16=s["bf16"], fp16=False, gradient_checkpointing=False,
        per_device_train_batch_size=s["micro"], gradient_accumulation_steps=rows // s["micro"],
        num_generations=s["n"], max_completion_length=s["max_new_tokens"], temperature=s["temperature"],
        top_p=1.0, top_k=0, beta=0.0, num_iterations=s["epochs"], epsilon=s["clip"], epsilon_high=s["clip_high"],
        loss_type="dapo", scale_rewards="group" if s["norm_std"] else "none", learning_rate=s["lr"],
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=s["grad_clip"],
        use_vllm=False, max_steps=s["iterations"], shuffle_dataset=False, seed=SEED, logging_steps=1,
        report_to=[], save_strategy="no", disable_tqdm=True, dataloader_num_workers=0, log_completions=False,
    )
    assert args.generation_batch_size == rows, (args.generation_batch_size, rows)
    assert not getattr(args, "activation_checkpointing", args.gradient_checkpointing), "checkpointing must be off"

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.begin: dict[int, float] = {}
            self.end: dict[int, float] = {}
            self.logs: dict[int, dict] = {}

        def on_step_begin(self, a, state, control, **kw):
            self.begin[state.global_step + 1] = time.perf_counter()

        def on_step_end(self, a, state, control, **kw):
            self.end[state.global_step] = time.perf_counter()
            step = state.global_step
            print(f"TRL step {step} done: {self.end[step] - self.begin.get(step, self.end[step]):.1f} s "
                  f"(step begin -> end)", flush=True)

        def on_log(self, a, state, control, logs=None, **kw):
            self.logs.setdefault(state.global_step, {}).update(logs or {})

    timer = StepTimer()
    trainer = GRPOTrainer(model=model, reward_funcs=make_reward_fn(s["format_bonus"]), args=args,
                          train_dataset=trl_dataset(s), processing_class=tokenizer, callbacks=[timer])
    print(f"TRL {trl.__version__}: GRPOTrainer, {threads} torch threads, generation batch "
          f"{args.generation_batch_size}, steps_per_generation {args.steps_per_generation}", flush=True)
    t0 = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t0
    per_it = []
    for i in range(1, s["iterations"] + 1):
        prev = timer.end.get(i - 1)
        s_iter = timer.end[i] - prev if prev is not None else math.nan
        log = timer.logs.get(i, {})
        mean_len = log.get("completions/mean_length", math.nan)
        per_it.append({"iteration": i, "s_iter": s_iter, "step_begin_to_end": timer.end[i] - timer.begin[i],
                       "gen_tokens": mean_len * rows, "reward": log.get("reward", math.nan)})
    del trainer, model
    gc.collect()
    return {"per_iteration": per_it, "wall_s": wall}


# --------------------------------------------------------------------------------------------- report


def summarise(name: str, res: dict, rows: int) -> dict:
    warm = [r for r in res["per_iteration"] if r["iteration"] > 1]
    s_iter = median([r["s_iter"] for r in warm])
    tok = median([r["gen_tokens"] / r["s_iter"] for r in warm])
    out = {"s_iter": s_iter, "tok_s": tok, "samples_s": rows / s_iter,
           "mean_len": median([r["gen_tokens"] / rows for r in warm])}
    print(f"{name:9s} {s_iter:10.2f} {tok:14.1f} {out['samples_s']:12.2f} {out['mean_len']:16.1f}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=5, help="timed iterations after one warm-up (default 5: one TRL iteration moves from 55 to 98 s)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--quick", action="store_true", help="smoke test: 1 timed iteration, 16 new tokens")
    ap.add_argument("--only", choices=["trl", "trajflow"], help="run one side only (no ratio)")
    ap.add_argument("--keep", action="store_true", help="keep the run directories (removed at exit otherwise)")
    ap.add_argument("--precision", choices=["auto", "fp32", "bf16"], default="auto",
                    help="both sides in fp32, or both in bf16 compute (auto: bf16 where this CPU has AMX/AVX512-BF16)")
    ap.add_argument("--allocator", default="auto", help="resources.allocator for this process and the workers: "
                    "auto (tcmalloc if installed), system, or a library path")
    args = ap.parse_args()
    allocator = preload_allocator(args.allocator)
    print(f"allocator: {allocator}", flush=True)
    if args.quick:
        args.iterations, args.max_new_tokens = 1, 16
    s = shared_settings(args)
    rows = s["prompts"] * s["n"]
    print(f"settings: {'bf16 compute' if s['bf16'] else 'fp32'} on both sides; {s['prompts']} prompts x {s['n']} samples, "
          f"{s['max_new_tokens']} new tokens, temperature "
          f"{s['temperature']}, lr {s['lr']}, micro-batch {s['micro']}, 1 warm-up + {args.iterations} timed iterations")
    results = {}
    if args.only != "trl":
        header("trajflow")
        results["trajflow"] = run_trajflow_side(s)
    if args.only != "trajflow":
        header("TRL")
        results["trl"] = run_trl_side(s)

    header("per iteration")
    for name, res in results.items():
        for r in res["per_iteration"]:
            extra = "  ".join(f"{k}={v:.2f}" for k, v in r.items() if k not in ("iteration", "s_iter", "gen_tokens"))
            print(f"{name:9s} it {r['iteration']}: {r['s_iter']:7.2f} s/iter  {r['gen_tokens']:6.0f} tokens  {extra}")
    header(f"median over {args.iterations} warm iteration(s)")
    print(f"{'':9s} {'s/iter':>10s} {'gen tokens/s':>14s} {'samples/s':>12s} {'mean resp len':>16s}")
    summ = {name: summarise(name, res, rows) for name, res in results.items()}
    if "trajflow" in results:
        tf = [r for r in results["trajflow"]["per_iteration"] if r["iteration"] > 1]
        old_lp = median([r["timing_s/old_log_prob"] for r in tf])
        old_lp = 0.0 if math.isnan(old_lp) else old_lp
        print(f"trajflow timing_s/step (rollout -> update, before logging): {median([r['timing_s/step'] for r in tf]):.2f} s; "
              f"of which a separate old-log-prob forward {old_lp:.2f} s (TRL skips it in this on-policy setting)")
    if len(summ) == 2:
        ratio = summ["trl"]["s_iter"] / summ["trajflow"]["s_iter"]
        print(f"\ntrajflow iteration throughput / TRL's = TRL s/iter / trajflow s/iter = "
              f"{summ['trl']['s_iter']:.2f} / {summ['trajflow']['s_iter']:.2f} = {ratio:.2f}x")
        print(f"(tokens/s ratio {summ['trajflow']['tok_s'] / summ['trl']['tok_s']:.2f}x: responses differ in length "
              f"between the two samplers)")
        verdict("trajflow iteration throughput vs TRL (ratio)", ratio, TARGET_RATIO, fmt="{:.2f}")


if __name__ == "__main__":
    main()
