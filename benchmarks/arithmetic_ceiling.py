"""What the default recipe can learn: held-out accuracy by operation, greedy and pass@k, of the
untrained model or a checkpoint.

RL on a group of samples can only reinforce answers the policy samples: a problem none of its k
samples solves gives every row of its group the same reward and no gradient (GRPO's advantage is 0).
pass@k of the *untrained* policy at the rollout temperature is therefore a rough ceiling for what the
greedy policy reaches after a short run. This script prints, for the held-out problems of a
``basic_arithmetic`` dataset spec, split into addition, subtraction with a result >= 0 and
subtraction with a negative result:

- greedy accuracy (the validation metric, ``val-core/.../acc/mean@1``);
- with ``--k K``: the mean accuracy of K samples at temperature 1 and pass@K (a problem counts when
  any of its K samples is right).

Scored with the recipe's own scorer (``trajflow.stages.scorers.reasoning_gym_scorer``); sampled with the HF
rollout engine in ``--dtype`` (the rollout precision). docs/recipe-sweep.md quotes its output.

    .venv/bin/python benchmarks/arithmetic_ceiling.py                      # untrained, default spec
    .venv/bin/python benchmarks/arithmetic_ceiling.py --k 16 --problems 128
    .venv/bin/python benchmarks/arithmetic_ceiling.py --checkpoint runs/<run_id>/checkpoints/000050
    .venv/bin/python benchmarks/arithmetic_ceiling.py --dataset my_prompt_variant.yaml
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

from _common import header, set_all_threads


def operation(question: str, answer: str) -> str:
    """``add``, ``sub`` (result >= 0) or ``sub<0`` for a two-term ``basic_arithmetic`` question."""
    if "+" in question:
        return "add"
    return "sub<0" if int(answer) < 0 else "sub"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dataset", default="basic_arithmetic", help="dataset spec name or YAML path")
    ap.add_argument("--checkpoint", default=None, help="a checkpoint folder of a full-weight run "
                    "(runs/<run_id>/checkpoints/<N>); default: the untrained model")
    ap.add_argument("--problems", type=int, default=256, help="first N held-out problems")
    ap.add_argument("--k", type=int, default=0, help="samples per problem at temperature 1 (0: greedy only)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"], help="rollout precision")
    args = ap.parse_args()
    set_all_threads()

    from pathlib import Path

    from safetensors.torch import load_file

    from trajflow.stages.rollout import SamplingParams
    from trajflow.stages.scorers import reasoning_gym_scorer
    from trajflow.config import load_config
    from trajflow.engines.hf import HFRolloutEngine
    from trajflow.models import chat_prompt_ids, eos_token_ids, load_causal_lm, load_tokenizer, resolve_model_path
    from trajflow.prompts.loading import load_prompt_dataset

    cfg = load_config(None, [])
    path = resolve_model_path(cfg.model.path, cfg.model.cache_dir)
    tokenizer = load_tokenizer(path)
    model = load_causal_lm(path, "float32")
    if args.checkpoint:
        weights = Path(args.checkpoint) / "actor" / "model.safetensors"
        if not weights.is_file():
            raise SystemExit(f"error: --checkpoint {args.checkpoint}: no {weights} (a full-weight checkpoint)")
        missing, unexpected = model.load_state_dict(load_file(str(weights)), strict=False)
        if unexpected or [m for m in missing if "lm_head" not in m]:
            raise SystemExit(f"error: {weights} does not match {cfg.model.path}")
    engine = HFRolloutEngine(model, tokenizer.pad_token_id, eos_token_ids(tokenizer, model.config), 32,
                             dtype=None if args.dtype == "float32" else args.dtype)
    data = load_prompt_dataset(args.dataset)
    val = data.validation[:args.problems]
    ops = [operation(r.extra_info["question"], r.ground_truth) for r in val]
    prompts = [chat_prompt_ids(tokenizer, r.messages) for r in val]

    def accuracy(texts: list[str], k: int) -> list[list[float]]:
        per = [reasoning_gym_scorer(val[i // k].data_source, t, val[i // k].ground_truth, val[i // k].extra_info)["acc"]
               for i, t in enumerate(texts)]
        return [per[i * k:(i + 1) * k] for i in range(len(val))]

    def by_op(values: list[float]) -> str:
        groups: dict[str, list[float]] = defaultdict(list)
        for op, v in zip(ops, values):
            groups[op].append(v)
        return "  ".join(f"{op} {sum(v) / len(v):.3f} (n={len(v)})" for op, v in sorted(groups.items()))

    header(f"{args.dataset}, {len(val)} held-out problems, {'checkpoint ' + args.checkpoint if args.checkpoint else 'untrained'}"
           f", rollout {args.dtype}")
    t = time.perf_counter()
    out = engine.generate(prompts, SamplingParams(n=1, temperature=0.0, max_new_tokens=args.max_new_tokens))
    greedy = [a[0] for a in accuracy(tokenizer.batch_decode(out.response_ids, skip_special_tokens=True), 1)]
    print(f"greedy: {sum(greedy) / len(greedy):.3f}  |  {by_op(greedy)}  ({time.perf_counter() - t:.0f} s)", flush=True)
    if args.k:
        t = time.perf_counter()
        out = engine.generate(prompts, SamplingParams(n=args.k, temperature=1.0, max_new_tokens=args.max_new_tokens,
                                                      seed=1))
        acc = accuracy(tokenizer.batch_decode(out.response_ids, skip_special_tokens=True), args.k)
        mean = [sum(a) / len(a) for a in acc]
        passk = [float(max(a)) for a in acc]
        print(f"temperature 1, mean of {args.k}: {sum(mean) / len(mean):.3f}  |  {by_op(mean)}", flush=True)
        print(f"pass@{args.k}: {sum(passk) / len(passk):.3f}  |  {by_op(passk)}  ({time.perf_counter() - t:.0f} s)",
              flush=True)


if __name__ == "__main__":
    main()
