"""SmolLM2-135M-Instruct as an LLM judge (``reward.judge``), served by ``trajflow.serve.standalone`` and
called through the real ``openai`` client, on a small set of arithmetic answers whose correctness is
known (half right, half wrong).

    python benchmarks/judge_smollm2.py [--items 12] [--model smollm2-135m-instruct] [--few-shot] [--max-tokens 32]

Prints each verdict (the judge's reply, the parsed score, whether the answer was right), then:
the judgements that failed (``reward/judge_error_frac``), whether a second pass gave the same
verdicts (greedy, seeded), the mean judge score of right and of wrong answers, and the seconds per
judgement. Targets (PASS/MISS): every verdict parsed, the second pass identical. How well a 135M
model tells right from wrong is printed, not targeted: it is the model's skill, not trajflow's.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import set_all_threads, verdict  # noqa: E402


def items(k: int) -> list[tuple[str, str, str, bool]]:
    """``(question, answer, reference, right)``: two-term sums, every other answer off by a small amount."""
    import random

    rng = random.Random(0)
    out = []
    for i in range(k):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        right = i % 2 == 0
        answer = a + b if right else a + b + rng.choice([-11, -2, 3, 10])
        out.append((f"What is {a} + {b}?", f"{a} + {b} = {answer}", str(a + b), right))
    return out


#: Two graded examples, then the answer: what a small model copies the format from.
FEW_SHOT = ("Grade the answer: Score: 10 if it equals the reference, Score: 0 if not.\n\n"
            "Question: What is 12 + 30?\nReference: 42\nAnswer: 12 + 30 = 42\nScore: 10\n\n"
            "Question: What is 25 + 17?\nReference: 42\nAnswer: 25 + 17 = 52\nScore: 0\n\n"
            "Question: {question}\nReference: {ground_truth}\nAnswer: {response}\nScore:")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--items", type=int, default=12)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--few-shot", action="store_true", help="a template with two graded examples before the answer")
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()

    import numpy as np
    import torch

    from trajflow.config import load_config
    from trajflow.models import resolve_model_path
    from trajflow.serve.standalone import ModelServer
    from trajflow.stages.judge import judge_scores

    threads = set_all_threads()
    path = resolve_model_path(args.model)
    server = ModelServer(str(path), max_new_tokens=64).start()
    os.environ["TRAJFLOW_BENCH_JUDGE_KEY"] = server.token
    cfg = dict(load_config(None, ["reward.judge.enable=true", f"reward.judge.base_url={server.base_url}",
                                  "reward.judge.api_key_env=TRAJFLOW_BENCH_JUDGE_KEY",
                                  f"reward.judge.max_tokens={args.max_tokens}", "reward.judge.timeout_s=300"]).reward.judge)
    if args.few_shot:
        cfg["prompt_template"] = FEW_SHOT
    rows = items(args.items)
    prompts = [[{"role": "user", "content": q}] for q, _, _, _ in rows]
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}; torch "
          f"{torch.__version__}, {threads} threads; judge {args.model}, {len(rows)} answers, temperature "
          f"{cfg['temperature']}, seed {cfg['seed']}, {'the few-shot' if args.few_shot else 'the default'} prompt "
          f"template, up to {args.max_tokens} tokens", flush=True)
    try:
        t = time.perf_counter()
        first = judge_scores(cfg, prompts, [a for _, a, _, _ in rows], [g for _, _, g, _ in rows])
        secs = time.perf_counter() - t
        second = judge_scores(cfg, prompts, [a for _, a, _, _ in rows], [g for _, _, g, _ in rows])
    finally:
        server.stop()
    for (q, a, g, right), s, e, r in zip(rows, first.scores, first.errors, first.replies):
        print(f"{'right' if right else 'wrong'}  {a!r:22s} (ref {g}): "
              f"{'error ' + e if e else f'score {s:.2f}'}; reply {' '.join(str(r or '').split())[:70]!r}")
    errors = sum(e is not None for e in first.errors)
    ok = [e is None for e in first.errors]
    rights = [s for s, (_, _, _, r), k in zip(first.scores, rows, ok) if r and k]
    wrongs = [s for s, (_, _, _, r), k in zip(first.scores, rows, ok) if not r and k]
    print(f"reward/judge_error_frac {errors / len(rows):.3f}; mean judge score: right answers "
          f"{np.mean(rights) if rights else float('nan'):.3f}, wrong answers {np.mean(wrongs) if wrongs else float('nan'):.3f}; "
          f"{secs / len(rows):.2f} s per judgement ({cfg['concurrency']} at a time)")
    verdict("judgements parsed", 1 - errors / len(rows), 1.0, fmt="{:.2f}")
    same = first.scores.tolist() == second.scores.tolist() and first.replies == second.replies
    verdict("second pass identical (greedy, seeded)", float(same), 1.0, fmt="{:.0f}")


if __name__ == "__main__":
    main()
