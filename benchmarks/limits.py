"""How close trajflow's training step and generation come to this machine's limits.

Measures, in one process and one run (so that the fractions are not skewed by load changes between
runs):

1. **Matmul ceilings**: float32 and bf16 ``torch.mm`` of two ``n x n`` matrices (default n = 2048),
   torch threads = all CPUs, best of R runs: ``2 n^3 / seconds`` GFLOP/s.
2. **Plain forward token rate** of the default model (SmolLM2-135M-Instruct, fp32, sdpa):
   ``model(input_ids, attention_mask)`` under ``torch.no_grad``, no KV cache, full logits, on random
   token ids of shape batch 8 x 256 and batch 32 x 64, best of R: tokens / second.
3. **trajflow's training step** (``PolicyWorker.update_actor``, the method the flow's update task calls,
   here in-process without Ray): 8 prompts x 4 samples of the default dataset, sampled by the worker
   itself, with GRPO advantages of their real reasoning-gym scores; best of R updates after one
   warm-up update (the first one also allocates AdamW's state), with the default recipe's
   micro-batches (``actor.use_dynamic_bsz`` with a 2048-token budget: this batch's ~760 computed
   tokens in one micro-batch; the target is judged on this setting), and for comparison with
   8-row micro-batches (the recipe before: more, smaller matmuls, the prompt prefix and the tied
   embedding's gradient once per micro-batch) and the whole batch in one micro-batch (run only if
   it cuts the batch differently from the recipe). Model FLOPs of one update::

       F = 6 * N_body * T_all                 # decoder layers, forward + backward (Kaplan et al. 2020)
         + 6 * d * V * T_resp                 # LM head, only on response positions (all trajflow computes)
         + 12 * L * d * sum(S^2 over the causal blocks trajflow runs)
                                              # attention scores and values, PaLM (Chowdhery et al. 2022, App. B)

   with N_body the non-embedding parameters, d the hidden size, V the vocabulary, L the layers, T_resp
   the response tokens and T_all the real (non-pad) tokens trajflow runs through the decoder: per
   micro-batch, the distinct prompts' common prefix once, each distinct prompt's remainder once and
   each row's response but its last token (``trajflow.modeling.tree.tree_packed_tokens``: the last
   token predicts nothing). The attention term sums, per block, (tokens seen after it)^2 - (tokens
   seen before it)^2: the causal attention each row needs, not the masked-out scores the dense tree
   mask also computes. Padding, softmax/entropy and the optimizer are not counted (they are not
   model FLOPs).
   MFU = F / update seconds / matmul ceiling of the update's compute dtype
   (``actor.mixed_precision.param_dtype``, ``auto``: bf16 where bf16 is fast; the higher of a
   measurement before and after). The
   brief's naive count (6 * all params * every row's prompt + response tokens, i.e. the prompt run
   once per sample and the LM head on prompt tokens too) is printed for reference: it is the work a
   trainer without prompt sharing does, so its "MFU" can exceed 100 %.
4. **trajflow's generation rate at batch 32** (``PolicyWorker.generate_sequences``: the HF engine's
   decode loop, 32 rows in one batch that shrinks as rows end): real generated tokens (EOS included,
   nothing after it) / seconds, best of R, as a fraction of the plain forward token rate at batch
   32 x 64. The "slot" rate (rows x longest response / seconds: what a batch that keeps its
   finished rows to the end, like ``generate``, would have processed) is shown too.
5. **Generation against its physical bound, in each precision** (issue 20: >= 70 % of the
   weight-read bound with fp32 and with bf16 weights). The same prompts are sampled by the HF engine
   on the fp32 module and on its bf16 rollout copy (``rollout.dtype``), ``rollout.micro_batch_size``
   decode slots with continuous batching, best of R. Every decode step reads all weights once
   (``itemsize x parameters``; memory read bandwidth = ``tensor.sum()`` over 1 GiB of float32, best
   of R), and no schedule of S slots finishes a batch of responses in fewer than
   ``steps_min = max(longest response, ceil(tokens / S))`` steps. The **weight-read bound** is
   ``tokens / (steps_min x weight bytes / bandwidth)`` tok/s. It ignores compute: a step of many rows
   also runs ``2 x (N_body + d V) x rows`` FLOPs, so the **roofline bound** divides the tokens by
   ``max(steps_min x read time, 2 (N_body + d V) tokens / matmul ceiling of that dtype)``, which no
   decode loop can beat either (a sum of per-step maxima is at least the maximum of the sums).
   Printed per precision: tok/s, decode steps taken vs ``steps_min``, both bounds and trajflow's
   fraction of each. Both use the square-matmul ceiling, which a decode step's matmuls (M = rows <=
   slots) do not reach on a CPU: the **decode-matmul bound** times the step's own linear layers
   (every ``nn.Linear`` weight of the decoder and the LM head, ``x @ W.T`` with ``x`` of ``slots``
   rows in that dtype, best of R) and divides the tokens by ``steps_min`` such steps. It is what a
   decode loop with torch's kernels could reach if the linear layers were all it ran (attention,
   norms, sampling and the cache are left out), so trajflow's fraction of it is the loop's overhead.

Every ratio depends on the CPU kind (bf16 matmuls are ~4x fp32 with AMX, slower than fp32 on AVX2):
the script prints the CPU's model name and bf16 matmul paths (:func:`cpu_kind`, from the kernel's
``/proc/cpuinfo``) first and beside each target line.

    .venv/bin/python benchmarks/limits.py [--quick] [--repeats R] [--max-new-tokens 64] [--matmul-n 2048]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from _common import preload_allocator, header, set_all_threads, verdict

TARGET_MFU = 0.60
TARGET_GEN = 0.50
TARGET_READ_BOUND = 0.70


def cpu_kind(cpuinfo: str = "/proc/cpuinfo") -> str:
    """This machine's CPU as the ratios depend on it: the model name and which of the bf16 matmul
    paths it has (``AMX`` tiles, ``AVX512-BF16`` dot products, else ``AVX512`` or ``AVX2`` only), read
    from ``cpuinfo``'s first processor, e.g. ``"Intel(R) Xeon(R) Processor [AMX, AVX512-BF16]"``.
    The bound-ratios below differ by kind: bf16 is ~4x fp32 with AMX and slower than fp32 on AVX2."""
    name, flags = "unknown CPU", set()
    try:
        with open(cpuinfo) as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and name == "unknown CPU":
                    name = " ".join(value.split())
                elif key == "flags":
                    flags = set(value.split())
                    break
    except OSError:
        return name
    paths = [label for flag, label in (("amx_bf16", "AMX"), ("avx512_bf16", "AVX512-BF16")) if flag in flags]
    if not paths:
        paths = ["AVX512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"]
    return f"{name} [{', '.join(paths)}]"


def matmul_gflops(n: int, repeats: int, dtype=None) -> tuple[float, list[float]]:
    import torch

    dtype = dtype or torch.float32
    a = torch.randn(n, n, dtype=dtype)
    b = torch.randn(n, n, dtype=dtype)
    c = torch.empty(n, n, dtype=dtype)
    torch.mm(a, b, out=c)  # warm-up
    rates = []
    for _ in range(repeats):
        t = time.perf_counter()
        torch.mm(a, b, out=c)
        rates.append(2 * n**3 / (time.perf_counter() - t) / 1e9)
    return max(rates), rates


def read_bandwidth(repeats: int, gib: float = 1.0) -> tuple[float, list[float]]:
    """Memory read bandwidth in GB/s: ``sum()`` over ``gib`` GiB of float32, best of ``repeats``."""
    import torch

    a = torch.ones(int(gib * 2**30) // 4, dtype=torch.float32)
    a.sum()  # warm-up (page faults)
    rates = []
    for _ in range(repeats):
        t = time.perf_counter()
        a.sum()
        rates.append(a.numel() * 4 / (time.perf_counter() - t) / 1e9)
    return max(rates), rates


def forward_rate(model, batch: int, seq: int, repeats: int, vocab: int) -> tuple[float, list[float]]:
    import torch

    g = torch.Generator().manual_seed(batch * 1000 + seq)
    ids = torch.randint(3, vocab, (batch, seq), generator=g)
    attn = torch.ones_like(ids)
    rates = []
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for _ in range(repeats):
            t = time.perf_counter()
            out = model(input_ids=ids, attention_mask=attn, use_cache=False)
            dt = time.perf_counter() - t
            del out
            rates.append(batch * seq / dt)
    model.train(was_training)
    return max(rates), rates


def model_dims(model) -> dict:
    c = model.config
    n_total = sum(p.numel() for p in model.parameters())
    n_emb = model.get_input_embeddings().weight.numel()
    head = model.get_output_embeddings().weight
    tied = head.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    n_body = n_total - n_emb - (0 if tied else head.numel())
    return dict(L=c.num_hidden_layers, d=c.hidden_size, V=c.vocab_size, n_total=n_total, n_body=n_body, tied=tied)


def update_flops(dims: dict, prompts: list[list[int]], resp_lens: list[int], plan: list[slice]) -> tuple[float, float, dict]:
    """(F, naive F, parts) for one update over the rows cut into ``plan``'s micro-batches; see the
    module doc for the formula.

    Counts what trajflow computes (:func:`trajflow.modeling.tree.tree_pack`): in each micro-batch of
    consecutive rows, the distinct prompts' common prefix once, each distinct prompt's remainder
    once, every row's response but its last token (the LM head on every response token). The naive
    count charges every row its own whole prompt and the LM head on every token (a trainer without
    prompt sharing).
    """
    from trajflow.modeling.tree import common_prefix_length

    t_prompt, attn_sq = 0.0, 0.0
    for sl in plan:
        distinct = list(dict.fromkeys(tuple(p) for p in prompts[sl]))
        c = common_prefix_length(distinct)
        t_prompt += c + sum(len(p) - c for p in distinct)
        attn_sq += c**2 + sum(len(p) ** 2 - c**2 for p in distinct)
    P = np.asarray([len(p) for p in prompts], dtype=np.float64)
    R = np.asarray(resp_lens, dtype=np.float64)
    R_in = np.maximum(R - 1, 0)  # a response's last token is never an input
    S = P + R_in
    attn_sq += float((S**2 - P**2).sum())
    t_all, t_resp = t_prompt + float(R_in.sum()), float(R.sum())
    body = 6 * dims["n_body"] * t_all
    head = 6 * dims["d"] * dims["V"] * t_resp
    attn = 12 * dims["L"] * dims["d"] * attn_sq
    S_all = P + R
    naive = 6 * dims["n_total"] * float(S_all.sum()) + 12 * dims["L"] * dims["d"] * float((S_all**2).sum())
    return body + head + attn, naive, dict(body=body, head=head, attn=attn, t_all=t_all, t_resp=t_resp,
                                           t_rows=float(S_all.sum()))


def grpo_advantages(scores: np.ndarray, n: int, eps: float = 1e-6) -> np.ndarray:
    """Group-normalised outcome advantages (Shao et al. 2024, DeepSeekMath, GRPO outcome supervision)."""
    g = scores.reshape(-1, n)
    return ((g - g.mean(1, keepdims=True)) / (g.std(1, ddof=1, keepdims=True) + eps)).reshape(-1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--matmul-n", type=int, default=2048)
    ap.add_argument("--quick", action="store_true", help="smoke test: 1 repeat, 16 new tokens")
    ap.add_argument("--allocator", default="auto", help="resources.allocator for this process and the workers: "
                    "auto (tcmalloc if installed), system, or a library path")
    args = ap.parse_args()
    allocator = preload_allocator(args.allocator)
    print(f"allocator: {allocator}", flush=True)
    if args.quick:
        args.repeats, args.max_new_tokens = 1, 16
    import dataclasses
    import resource

    import torch
    from omegaconf import OmegaConf

    from trajflow.stages.policy_update import UpdateBatch, UpdateRows, UpdateSettings
    from trajflow.stages.scorers import reasoning_gym_scorer
    from trajflow.stages.rollout import SamplingParams
    from trajflow.config import load_config
    from trajflow.prompts import PromptSampler, load_prompt_dataset
    from trajflow.models import resolve_model_path
    from trajflow.workers.policy import PolicyWorker

    threads = set_all_threads()
    kind = cpu_kind()
    print(f"CPU: {kind}", flush=True)
    cfg = load_config(None, [f"rollout.max_new_tokens={args.max_new_tokens}"])
    print(f"torch {torch.__version__}, {threads} threads; default recipe, {cfg.data.train_batch_size} prompts x "
          f"{cfg.rollout.n} samples, {args.max_new_tokens} new tokens; best of {args.repeats}")

    header(f"1. float32 and bf16 matmul {args.matmul_n}^3")
    peak, rates = matmul_gflops(args.matmul_n, max(3, args.repeats * 3))
    print(f"runs: {', '.join(f'{r:.1f}' for r in rates)} GFLOP/s; ceiling (best) {peak:.1f} GFLOP/s")
    peak16, rates16 = matmul_gflops(args.matmul_n, max(3, args.repeats * 3), torch.bfloat16)
    print(f"bf16: {', '.join(f'{r:.1f}' for r in rates16)} GFLOP/s; ceiling (best) {peak16:.1f} GFLOP/s")

    header("2. plain forward token rate (no grad, no cache, full logits)")
    path = resolve_model_path(cfg.model.path, cfg.model.cache_dir)
    section = lambda sec: OmegaConf.to_object(cfg[sec])  # noqa: E731
    t = time.perf_counter()
    worker = PolicyWorker(str(path), section("actor"), section("model"), section("rollout"), int(cfg.trainer.seed),
                          "cpu", int(cfg.trainer.num_threads))
    # What the default recipe's resources.release_memory=auto resolves to (no other model worker).
    worker.release_memory = False
    # The update's MFU is judged against the matmul ceiling of its compute dtype (auto: bf16 where fast).
    upd_dtype = worker.param_dtype
    upeak = peak16 if upd_dtype == "bfloat16" else peak
    print(f"update compute dtype {upd_dtype}: matmul ceiling {upeak:.1f} GFLOP/s")
    print(f"policy worker (in-process) ready in {time.perf_counter() - t:.1f} s; torch threads {worker.threads}")
    model = worker.model
    dims = model_dims(model)
    print(f"model: {dims['n_total'] / 1e6:.1f} M parameters ({dims['n_body'] / 1e6:.1f} M non-embedding), "
          f"L={dims['L']} d={dims['d']} V={dims['V']}, tied head={dims['tied']}")
    forward_rate(model, 2, 32, 1, dims["V"])  # warm-up
    fwd = {}
    for b, s in ((8, 256), (32, 64)):
        best, rs = forward_rate(model, b, s, args.repeats, dims["V"])
        fwd[(b, s)] = best
        gf = 2 * (dims["n_body"] + dims["d"] * dims["V"]) * best / 1e9
        print(f"batch {b:2d} x {s:3d}: {', '.join(f'{r:.0f}' for r in rs)} tok/s; best {best:.0f} tok/s "
              f"(~{gf:.1f} GFLOP/s, {gf / peak:.0%} of matmul)")

    header("3./4. trajflow policy worker: generation at batch 32, old log-probs, update")
    ds = load_prompt_dataset(cfg.data.dataset)
    prompts = PromptSampler(ds.train, cfg.data.train_batch_size, cfg.trainer.seed).next_batch()
    prompt_ids = worker.tokenize_prompts([p.messages for p in prompts], cfg.data.max_prompt_length)
    n = cfg.rollout.n
    rows_prompt = [p for p in prompt_ids for _ in range(n)]
    gen_rates, slot_rates, gen = [], [], None
    for r in range(args.repeats):
        params = SamplingParams(n=n, temperature=cfg.rollout.temperature, top_p=1.0, top_k=0,
                                max_new_tokens=args.max_new_tokens, seed=1000 + r)
        gen = worker.generate_sequences(prompt_ids, params, False)
        lens = [len(x) for x in gen.response_ids]
        gen_rates.append(sum(lens) / gen.timing["timing_s/gen"])
        slot_rates.append(len(lens) * max(lens) / gen.timing["timing_s/gen"])
        print(f"generate {len(lens)} rows: {gen.timing['timing_s/gen']:.2f} s, {sum(lens)} tokens (mean {np.mean(lens):.1f}, "
              f"max {max(lens)}): {gen_rates[-1]:.1f} tok/s real, {slot_rates[-1]:.1f} tok/s slots")
    gen_rate = max(gen_rates)
    resp = gen.response_ids
    t = time.perf_counter()
    old = worker.compute_log_prob(rows_prompt, resp, cfg.rollout.temperature)
    t_old = time.perf_counter() - t
    prefix = ds.train[0].data_source
    scores = np.array([reasoning_gym_scorer(p.data_source, text, str(p.ground_truth), p.extra_info)["score"]
                       for p, text in zip([p for p in prompts for _ in range(n)], gen.response_text)])
    adv = grpo_advantages(scores, n)
    batch = UpdateBatch(UpdateRows(rows_prompt, resp, [o.tolist() for o in old],
                                   [[float(a)] * len(r) for a, r in zip(adv, resp)]),
                        UpdateSettings(mini_batch_rows=cfg.actor.ppo_mini_batch_size * n, shuffle_seed=0))
    p_lens, r_lens = [len(p) for p in rows_prompt], [len(x) for x in resp]
    print(f"rows {len(resp)} ({prefix}, scores mean {scores.mean():.2f}); mean prompt {np.mean(p_lens):.0f} tokens, "
          f"responses {sum(r_lens)} tokens (mean {np.mean(r_lens):.1f}, max {max(r_lens)})")
    # The recipe's micro-batching first, then fixed 8-row micro-batches (more, smaller matmuls; the
    # prompt prefix and the tied embedding's gradient once per micro-batch) and the whole batch in
    # one micro-batch; settings that cut this batch the same way are run once.
    from trajflow.modeling.packing import micro_batch_plan

    recipe = {k: getattr(worker.actor, k) for k in ("use_dynamic_bsz", "ppo_max_token_len_per_gpu", "ppo_micro_batch_size")}
    budget = int(recipe["ppo_max_token_len_per_gpu"]) if recipe["use_dynamic_bsz"] else None
    settings = [(f"the default recipe's (token budget {budget})" if budget else
                 f"the default recipe's ({recipe['ppo_micro_batch_size']}-row micro-batches)", budget,
                 int(recipe["ppo_micro_batch_size"])),
                ("8-row micro-batches", None, 8), ("one 32-row micro-batch", None, len(resp))]
    results, seen = {}, set()
    for label, max_tokens, mb in settings:
        plan = micro_batch_plan(rows_prompt, resp, mb, max_tokens)
        key = tuple((sl.start, sl.stop) for sl in plan)
        if key in seen:
            continue
        seen.add(key)
        worker.actor = dataclasses.replace(worker.actor, use_dynamic_bsz=bool(max_tokens), ppo_micro_batch_size=mb,
                                           ppo_max_token_len_per_gpu=max_tokens or recipe["ppo_max_token_len_per_gpu"])
        upd_times = []
        for r in range(1 + args.repeats):
            t = time.perf_counter()
            m = worker.update_actor(batch)
            upd_times.append(m.get("timing_s/update_actor", time.perf_counter() - t))
            print(f"{label}: update_actor {'(warm-up) ' if r == 0 else ''}{upd_times[-1]:.2f} s, "
                  f"grad_norm {m.get('actor/grad_norm', float('nan')):.3f}")
        t_upd = min(upd_times[1:])
        F, F_naive, parts = update_flops(dims, rows_prompt, r_lens, plan)
        results[label] = (t_upd, F, F_naive, parts, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20)
        print(f"{label}: {len(plan)} micro-batch(es) of {', '.join(str(sl.stop - sl.start) for sl in plan)} rows; "
              f"tokens computed {parts['t_all']:.0f} (responses {parts['t_resp']:.0f}; per "
              f"micro-batch the common prefix once and each group's rest once; {parts['t_rows']:.0f} if every row ran "
              f"its own prompt); FLOPs body {parts['body'] / 1e12:.3f} + head {parts['head'] / 1e12:.3f} + attention "
              f"{parts['attn'] / 1e12:.3f} = {F / 1e12:.3f} TFLOP (naive 6*N_all*T + attn: {F_naive / 1e12:.3f})")
        print(f"{label}: update best {t_upd:.2f} s -> {F / t_upd / 1e9:.1f} GFLOP/s = MFU {F / t_upd / 1e9 / upeak:.1%} "
              f"of {upeak:.1f} (naive count: {F_naive / t_upd / 1e9 / upeak:.1%}); peak RSS of this process so far "
              f"{results[label][4]:.2f} GiB")
    worker.actor = dataclasses.replace(worker.actor, **recipe)
    recipe_label = settings[0][0]
    t_upd, F, F_naive, parts, _ = results[recipe_label]
    F_fwd = (parts["body"] + parts["head"] + parts["attn"]) / 3
    print(f"teacher-forced log-prob forward (compute_log_prob): {t_old:.2f} s -> {F_fwd / t_old / 1e9:.1f} GFLOP/s = {F_fwd / t_old / 1e9 / upeak:.1%} of matmul")
    # The load of a shared machine drifts: measure the ceiling again and keep the higher one (lower MFU).
    peak2, rates2 = matmul_gflops(args.matmul_n, max(3, args.repeats * 3), getattr(torch, upd_dtype))
    print(f"{upd_dtype} matmul again: {', '.join(f'{r:.1f}' for r in rates2)} GFLOP/s", end="")
    if peak2 > upeak:
        upeak = peak2
        print(f"; ceiling now {upeak:.1f} GFLOP/s", end="")
    print()
    mfus = {label: res[1] / res[0] / 1e9 / upeak for label, res in results.items()}
    for label, v in mfus.items():
        print(f"update MFU, {label}: {v:.1%}")
    gen_frac = gen_rate / fwd[(32, 64)]
    print(f"generation at batch 32: best {gen_rate:.1f} real tok/s ({max(slot_rates):.1f} slot tok/s) vs plain forward "
          f"32 x 64 {fwd[(32, 64)]:.0f} tok/s -> {gen_frac:.1%} ({max(slot_rates) / fwd[(32, 64)]:.1%} counting slots)")
    print(f"peak RSS of this process: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB")

    header("5. generation against its physical bound, fp32 and bf16 weights")
    bw, bws = read_bandwidth(max(3, args.repeats * 3))
    print(f"memory read: {', '.join(f'{r:.1f}' for r in bws)} GB/s; best {bw:.1f} GB/s")
    bounds = generation_bounds(worker, prompt_ids, n, args.max_new_tokens, args.repeats, dims, bw,
                               {"float32": peak, "bfloat16": peak16})

    header(f"targets on {kind}")
    verdict(f"[{kind}] training step MFU, {recipe_label} (fraction of matmul GFLOP/s)", mfus[recipe_label],
            TARGET_MFU, fmt="{:.1%}")
    verdict(f"[{kind}] generation rate at batch 32 / plain forward tok/s (32 x 64)", gen_frac, TARGET_GEN,
            fmt="{:.1%}")
    for dtype, (frac_read, frac_roof, frac_mm) in bounds.items():
        verdict(f"[{kind}] generation, {dtype} weights: fraction of the weight-read bound", frac_read,
                TARGET_READ_BOUND, fmt="{:.1%}")
        print(f"      [{kind}] (of the roofline bound {frac_roof:.1%}, of the decode-matmul bound {frac_mm:.1%})")


def decode_matmul_seconds(model, rows: int, dtype, repeats: int) -> float:
    """Seconds the linear layers of one decode step of ``rows`` rows take: every ``nn.Linear`` weight
    of the decoder plus the LM head, ``x @ W.T`` with ``x`` of shape ``(rows, in_features)``, weights
    cast to ``dtype``; the best of ``repeats`` timings of the whole set."""
    import torch

    head = model.get_output_embeddings()
    weights = [m.weight.detach().to(dtype) for m in model.get_decoder().modules() if isinstance(m, torch.nn.Linear)]
    weights.append(head.weight.detach().to(dtype))
    xs = [torch.randn(rows, w.shape[1], dtype=dtype) for w in weights]
    best = float("inf")
    with torch.no_grad():
        for _ in range(1 + repeats):  # the first pass warms the kernels up
            t = time.perf_counter()
            for x, w in zip(xs, weights):
                torch.matmul(x, w.T)
            best = min(best, time.perf_counter() - t)
    return best


def generation_bounds(worker, prompt_ids: list[list[int]], n: int, max_new_tokens: int, repeats: int, dims: dict,
                      bw: float, peaks: dict[str, float]) -> dict[str, tuple[float, float, float]]:
    """Section 5 of the module doc: per dtype, the best fraction of the weight-read bound, of the
    roofline bound and of the decode-matmul bound that the HF engine reaches over ``repeats`` sampled
    batches."""
    import math

    import torch

    from trajflow.stages.rollout import SamplingParams
    from trajflow.engines.hf import HFRolloutEngine

    slots = int(worker.rollout.micro_batch_size)
    out: dict[str, tuple[float, float]] = {}
    for dtype, peak in peaks.items():
        engine = HFRolloutEngine(worker.model, worker.pad_id, worker.eos_ids, slots, "cpu",
                                 dtype=None if dtype == "float32" else dtype)
        itemsize = 4 if dtype == "float32" else 2
        t_read = itemsize * dims["n_total"] / (bw * 1e9)
        flops_per_token = 2 * (dims["n_body"] + dims["d"] * dims["V"])
        t_mm = decode_matmul_seconds(worker.model, slots, getattr(torch, dtype), repeats=max(3, repeats * 3))
        print(f"{dtype}: the linear layers of one decode step of {slots} rows take {t_mm * 1e3:.1f} ms "
              f"({flops_per_token * slots / t_mm / 1e9:.0f} GFLOP/s, {flops_per_token * slots / t_mm / 1e9 / peak:.0%} "
              f"of the {peak:.0f} GFLOP/s square-matmul ceiling; {t_read * 1e3:.1f} ms to read the weights once)",
              flush=True)
        best = (0.0, 0.0, 0.0)
        for r in range(1 + repeats):
            params = SamplingParams(n=n, temperature=1.0, max_new_tokens=max_new_tokens, seed=2000 + r)
            t = time.perf_counter()
            gen = engine.generate(prompt_ids, params)
            dt = time.perf_counter() - t
            lens = [len(x) for x in gen.response_ids]
            tokens = sum(lens)
            steps_min = max(max(lens), math.ceil(tokens / slots))
            read_bound = tokens / (steps_min * t_read)
            roof_bound = tokens / max(steps_min * t_read, flops_per_token * tokens / (peak * 1e9))
            mm_bound = tokens / (steps_min * t_mm)
            rate = tokens / dt
            print(f"{dtype} weights{' (warm-up)' if r == 0 else ''}: {len(lens)} rows in {slots} slots, {tokens} tokens "
                  f"(longest {max(lens)}) in {dt:.2f} s = {rate:.1f} tok/s; decode steps {gen.stats.get('decode_steps')} "
                  f"(fewest possible {steps_min}); weight-read bound {read_bound:.0f} tok/s ({t_read * 1e3:.1f} ms a "
                  f"step) -> {rate / read_bound:.1%}; roofline bound {roof_bound:.0f} tok/s -> {rate / roof_bound:.1%}; "
                  f"decode-matmul bound {mm_bound:.0f} tok/s -> {rate / mm_bound:.1%}", flush=True)
            if r:
                best = max(best, (rate / read_bound, rate / roof_bound, rate / mm_bound))
        out[dtype] = best
        del engine
    return out


if __name__ == "__main__":
    main()
