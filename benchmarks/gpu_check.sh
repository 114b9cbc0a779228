#!/usr/bin/env bash
# The CUDA path end to end on one CUDA machine, in under 5 minutes:
#   1. correctness: tests/test_cuda.py (CUDA training against the CPU result, overlap exact, bf16 both
#      ways, over gRPC and shared memory), streamed weights on the device (tests/test_cuda_stream.py: pinned
#      staging, side-stream host copies) and the CUDA round trip of tests/test_client.py;
#   2. step time: benchmarks/peers.py --device cuda, DDP over NCCL beside shardps bsp with overlap off
#      and on, fp32 and bf16 on the wire (one worker per GPU; 2 workers when 2 GPUs are visible).
# Run from anywhere: benchmarks/gpu_check.sh  (PYTHON=... to use another interpreter than .venv's).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
"$PY" - <<'PYEOF'
import torch
assert torch.cuda.is_available(), "gpu_check.sh needs a CUDA device (torch.cuda.is_available() is False)"
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.device_count()} x "
      f"{torch.cuda.get_device_name(0)}")
PYEOF
GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count())")
WORKERS=$(( GPUS >= 2 ? 2 : 1 ))
echo "== correctness"
timeout 180 "$PY" -m pytest -q -rs tests/test_cuda.py tests/test_cuda_stream.py \
    "tests/test_client.py::test_cuda_parameters_round_trip"
echo "== step time: $WORKERS worker(s), 25.2M-parameter MLP, batch 64"
timeout 240 "$PY" benchmarks/peers.py --device cuda --workers "$WORKERS" --threads 4 --systems ddp,bsp \
    --steps 20 --warmup 5 --max-seconds 230
