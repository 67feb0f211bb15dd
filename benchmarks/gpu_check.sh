#!/usr/bin/env bash
# GPU check: two iterations of the default recipe on one GPU with the vLLM rollout engine and the
# DeepSpeed policy update, printing seconds and tokens/s per stage (benchmarks/iteration.py).
# Needs a CUDA GPU and `pip install 'trajflow[gpu]'` (see infra/docker/Dockerfile). Budget: 8 minutes
# (measured parts: model conversion ~20 s on first use, vLLM start-up, DeepSpeed start-up, 2 iterations).
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
