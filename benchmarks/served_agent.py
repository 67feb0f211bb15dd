"""Server-mode rollout vs the built-in multi-turn loop: the same policy worker, engine, prompts and
sampling settings, episodes of the calculator task run (1) by the built-in ``tool_calculator``
environment (``rollout.multi_turn``) and (2) by ``examples/agents/calculator_agent.py`` through the
OpenAI-compatible endpoint (``rollout.agent``), alternating.

    python benchmarks/served_agent.py [--prompts 8] [--n 2] [--repeats 1] [key=value ...]

Prints per run: episodes, generated tokens (``loss_mask`` 1), seconds, generated tokens/s, assistant
turns, tool calls, and for the served path the calls the agent made, the engine ``generate`` calls
and the drift tokens (``rollout/tito_drift_tokens``). Target (PASS/MISS): the served path generates
at least 0.8x the built-in loop's tokens per second (HTTP, JSON and the agent's own work cost little
next to decoding). Both paths are warmed up first (sandbox processes, the endpoint, the agent's imports).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import policy_worker, set_all_threads, verdict  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()

    import torch

    from trajflow.stages.rollout import sampling_params
    from trajflow.config import load_config
    from trajflow.prompts import PromptSampler, load_prompt_dataset

    threads = set_all_threads()
    cfg = load_config("grpo_tool_calculator", ["rollout.agent=examples.agents.calculator_agent:agent",
                                               "rollout.multi_turn.allow_weaker_sandbox=true", *args.overrides])
    worker = policy_worker(cfg)
    ds = load_prompt_dataset(cfg.data.dataset)
    prompts = PromptSampler(ds.train, args.prompts, cfg.trainer.seed).next_batch()
    rows = [{"messages": p.messages, "ground_truth": str(p.ground_truth), "data_source": p.data_source,
             "extra_info": p.extra_info, "prompt_id": str(p.prompt_id)} for p in prompts for _ in range(args.n)]
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}; torch "
          f"{torch.__version__}, {threads} threads; {cfg.model.path}, {len(rows)} episodes, temperature "
          f"{cfg.rollout.temperature}, up to {cfg.rollout.max_new_tokens} tokens per episode")
    # Warm-up, untimed: the sandbox's processes, the endpoint's start and the agent's imports.
    warm = sampling_params(cfg.rollout, 1, n=1)
    worker.generate_episodes(rows[:1], warm, int(cfg.data.max_prompt_length))
    worker.generate_agent_episodes(rows[:1], warm, int(cfg.data.max_prompt_length))
    rates: dict[str, list[float]] = {"built-in": [], "served": []}
    for r in range(args.repeats):
        params = sampling_params(cfg.rollout, 1000 + r, n=1)
        for label in ("built-in", "served"):
            t = time.perf_counter()
            if label == "built-in":
                gen = worker.generate_episodes(rows, params, int(cfg.data.max_prompt_length))
            else:
                gen = worker.generate_agent_episodes(rows, params, int(cfg.data.max_prompt_length))
            secs = time.perf_counter() - t
            eps = gen.episodes
            generated = sum(sum(e.loss_mask) for e in eps)
            rates[label].append(generated / secs)
            line = (f"{label:9s} run {r}: {len(eps)} episodes, {generated} generated tokens in {secs:.1f} s = "
                    f"{generated / secs:.1f} tok/s; turns {sum(e.num_turns for e in eps)}, "
                    f"tool calls {sum(len(e.tool_calls) for e in eps)}")
            if label == "served":
                line += (f"; agent calls {sum(e.agent_calls for e in eps)}, drift tokens "
                         f"{sum(e.tito_drift_tokens for e in eps)} (in {sum(e.tito_drift_tokens > 0 for e in eps)} "
                         f"episodes), agent errors {sum(e.agent_error is not None for e in eps)}")
                kinds = Counter(str(e.agent_error).split(":")[0] for e in eps if e.agent_error is not None)
                if kinds:
                    line += " (" + ", ".join(f"{k} x{v}" for k, v in kinds.most_common()) + ")"
            print(line, flush=True)
    served, builtin = sum(rates["served"]) / len(rates["served"]), sum(rates["built-in"]) / len(rates["built-in"])
    verdict("served / built-in generated tokens per second", served / builtin, 0.8, fmt="{:.2f}")


if __name__ == "__main__":
    main()
