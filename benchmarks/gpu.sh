#!/usr/bin/env bash
# The GPU tier, on whatever GPUs this machine has: the GPU tests, then DDP and FSDP step
# times and memory against PyTorch's on NCCL. Results go to benchmarks/gpu-results-<date>.md.
#
#     bash benchmarks/gpu.sh            # from the repository root, after `make venv`
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
out="benchmarks/gpu-results-$(date -u +%Y%m%d-%H%M%S).md"
{
  echo "# GPU tier, $(date -u)"
  echo
  echo '```'
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 || echo "nvidia-smi not found"
  "$PY" -m dptrain env
  echo '```'
  echo
  echo "## tests/gpu"
  echo '```'
  "$PY" -m pytest -q -p no:cacheprovider tests/gpu -rs 2>&1 | tail -20
  echo '```'
  echo
  echo "## DDP and FSDP on NCCL (benchmarks/gpu_step.py)"
  echo
  "$PY" benchmarks/gpu_step.py 2>&1
} | tee "$out"
echo "written to $out"
