#!/usr/bin/env bash
# GPU check: two iterations of the default recipe on one GPU with the vLLM rollout engine and the
# DeepSpeed policy update, printing seconds and tokens/s per stage (benchmarks/iteration.py).
# Needs a CUDA GPU and `pip install 'trajflow[gpu]'` (see infra/docker/Dockerfile). Budget: 8 minutes
# (measured parts: model conversion ~20 s on first use, vLLM start-up, DeepSpeed start-up, 2 iterations).
# Then, with 2 GPUs, synchronous vs overlapped rollout and training (benchmarks/overlap.py; 10 minutes).
#
#   bash benchmarks/gpu_check.sh [extra key=value overrides]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python )}

"$PY" - <<'PYCHECK'
import importlib.util, sys
import torch
problems = []
if not torch.cuda.is_available():
    problems.append("no CUDA GPU visible (torch.cuda.is_available() is False)")
for mod in ("vllm", "deepspeed"):
    if importlib.util.find_spec(mod) is None:
        problems.append(f"{mod} is not installed: pip install 'trajflow[gpu]'")
if problems:
    sys.exit("gpu_check: " + "; ".join(problems))
print(f"gpu_check: {torch.cuda.get_device_name(0)}, torch {torch.__version__}", flush=True)
PYCHECK

export DS_ACCELERATOR=cuda
start=$(date +%s)
timeout --signal=INT 480 "$PY" benchmarks/iteration.py --iterations 2 \
    trainer.device=cuda model.dtype=bfloat16 \
    rollout.engine=vllm rollout.gpu_memory_utilization=0.35 \
    actor.strategy=deepspeed actor.zero_stage=2 actor.world_size=1 \
    gates.enabled=false "$@"
echo "gpu_check: finished in $(( $(date +%s) - start )) s (budget 480 s)"

# Overlapped rollout and training (docs/overlap.md): synchronous vs trainer.max_staleness=1 with the
# rollout workers (vLLM) and the policy (DeepSpeed) on separate GPU pools of one GPU each; prints the
# iteration throughput ratio and writes overlap_timeline.png. Needs 2 GPUs. Budget: 10 minutes.
gpus=$("$PY" -c "import torch; print(torch.cuda.device_count())")
if [ "$gpus" -ge 2 ]; then
    start=$(date +%s)
    timeout --signal=INT 600 "$PY" benchmarks/overlap.py --iterations 6 --png overlap_timeline_gpu.png \
        trainer.device=cuda model.dtype=bfloat16 trainer.num_threads=0 \
        "resources.pools={train: {device: gpu, num_cpus_per_worker: 1}, gen: {device: gpu, num_cpus_per_worker: 1}}" \
        rollout.engine=vllm rollout.gpu_memory_utilization=0.6 \
        actor.strategy=deepspeed actor.zero_stage=2 actor.world_size=1 \
        gates.enabled=false "$@"
    echo "gpu_check: overlap finished in $(( $(date +%s) - start )) s (budget 600 s)"
else
    echo "gpu_check: overlap skipped: it needs 2 GPUs (one for the rollout pool, one for the actor's), found $gpus"
fi
