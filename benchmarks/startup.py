"""Start-up latency of the command line: how long trajflow takes to answer when it has nothing to start.

Three answers a user waits for, each timed as the user sees it (a new process, wall seconds, the
median of ``--repeats``), with the process's CPU seconds beside it (a loaded machine stretches the
wall time, not the CPU time):

- a misspelled key, ``trajflow train actor.lrr=1e-5``: rejected with one line. Target: < 1 s wall;
- a finished run resumed, ``trajflow resume RUN``: "nothing to do";
- ``trajflow config --check`` of the default recipe (its data, the model's tokenizer and weight
  headers, the reward function, the gates' suite and the store).

The finished run is a one-iteration smoke run of a tiny random model (SmolLM2's tokenizer), trained
first by the tree under test (1-3 minutes). ``--checkout DIR`` times another source tree (``PYTHONPATH=DIR python -m
trajflow.cli``), e.g. a checkout of an older commit, for a before/after comparison on one machine.

Usage: ``.venv/bin/python benchmarks/startup.py [--checkout DIR] [--repeats 3]``
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

from _common import REPO, header, median, scratch_dir, verdict

TARGET_BAD_KEY_S = 1.0


def _tiny_model(out: Path) -> Path:
    """A 2-layer Llama with SmolLM2's tokenizer and random weights (as the tests build it)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from trajflow.models import builtin_tokenizer_dir

    tok = AutoTokenizer.from_pretrained(builtin_tokenizer_dir("smollm2-135m-instruct"))
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
                         tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id)
    LlamaForCausalLM(config).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def _command(checkout: Path, args: list[str]) -> tuple[list[str], dict[str, str]]:
    env = dict(os.environ, PYTHONPATH=str(checkout))
    return [sys.executable, "-m", "trajflow.cli", *args], env


def timed(checkout: Path, args: list[str], cwd: Path, expect: int, needle: str) -> tuple[float, float]:
    """Wall and CPU seconds of one CLI process; its exit code and output are checked."""
    cmd, env = _command(checkout, args)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    out = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=600)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    text = out.stdout + out.stderr
    if out.returncode != expect or needle not in text:
        raise SystemExit(f"trajflow {' '.join(args)}: exit {out.returncode} (expected {expect}), "
                         f"{needle!r} not in output:\n{text[-3000:]}")
    return wall, cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkout", type=Path, action="append",
                    help="source tree to time (repeatable; default: this one)")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    work = scratch_dir("trajflow-startup-")
    model = _tiny_model(work / "tiny-model")
    for i, checkout in enumerate([c.resolve() for c in args.checkout or [REPO]]):
        # The finished run, trained by the tree under test (an older tree may not read a newer config).
        root = work / f"runs-{i}"
        cmd, env = _command(checkout, ["train", "-c", "smoke", f"model.path={model}", f"store.root={root}",
                                       "trainer.total_iterations=1", "trainer.test_freq=0",
                                       "rollout.max_new_tokens=4", "trainer.progress=false", "--run-id", "finished"])
        out = subprocess.run(cmd, env=env, cwd=work, capture_output=True, text=True, timeout=1200)
        if out.returncode != 0:
            raise SystemExit(f"could not train the finished run:\n{(out.stdout + out.stderr)[-3000:]}")
        measure(checkout, work, root, args.repeats)


def measure(checkout: Path, work: Path, root: Path, repeats: int) -> None:
    """Time the three answers of ``checkout``'s CLI and print them with the bad key's verdict."""
    with open("/proc/loadavg") as f:
        load = f.read().split()[0]
    header(f"CLI start-up, {checkout} (load average {load}, {os.cpu_count()} CPUs)")
    cases = [
        ("reject a misspelled key", ["train", "actor.lrr=1e-5"], 2, "did you mean 'actor.lr'"),
        ("resume a finished run (nothing to do)", ["resume", "finished", "--store", str(root)], 0, "nothing to do"),
        ("config --check (default recipe)", ["config", "--check"], 0, "recipe: grpo_default"),
    ]
    results = {}
    for name, cli_args, expect, needle in cases:
        runs = [timed(checkout, cli_args, work, expect, needle) for _ in range(repeats)]
        wall, cpu = median([w for w, _ in runs]), median([c for _, c in runs])
        results[name] = wall
        print(f"{name}: {wall:.2f} s wall, {cpu:.2f} s CPU (median of {repeats})", flush=True)
    verdict("misspelled key rejected (s, wall)", results["reject a misspelled key"], TARGET_BAD_KEY_S,
            higher_is_better=False, fmt="{:.2f}")


if __name__ == "__main__":
    main()
