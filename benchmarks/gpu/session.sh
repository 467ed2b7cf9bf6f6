#!/usr/bin/env bash
# What a lent GPU machine runs, in one call (about 6 minutes on one H100/H200):
# the suite's CUDA mode (make test-gpu), benchmarks/gpu/step.py, and the host-cost
# proxy on the GPU and on that machine's CPU. Every part has its own time
# limit and log, so one that fails or hangs leaves the others their time.
#   OUT=/some/dir PY=python3 bash benchmarks/gpu/session.sh
set -u
OUT=${OUT:-/tmp/gpu_session}
PY=${PY:-python3}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
part() {  # part NAME SECONDS COMMAND...
    local name=$1 limit=$2; shift 2
    echo "=== $name (limit ${limit} s)"
    local begin=$SECONDS
    timeout -k 10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "=== $name: rc=$rc in $((SECONDS - begin)) s"
    tail -n "${TAIL:-25}" "$OUT/$name.log"
}
{
    nvidia-smi -L
    $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version(), torch.cuda.get_device_name())"
} 2>&1 | tee "$OUT/env.log"
TAIL=40 part test_gpu 200 env FSDP_COMPOSE_TEST_DEVICE=cuda $PY -m pytest -q -p no:cacheprovider \
    --timeout 120 ${GPU_TESTS:-tests/core/test_cuda.py tests/core/test_parity.py tests/core/test_mixed_precision.py tests/runtime/test_collectives_and_memory.py tests/runtime/test_prefetch.py tests/tools/test_split_root.py tests/core/test_clip.py tests/runtime/test_bucketing.py tests/core/test_grad_scaler.py tests/tools/test_hf_trainer.py}
TAIL=30 part bench_gpu 240 $PY -m benchmarks.gpu --world2-timeout 150 --json "$OUT/gpu.json"
TAIL=8 part host_cost_cuda 60 $PY -m benchmarks.host_cost --device cuda --rounds 5
TAIL=8 part host_cost_cpu 60 $PY -m benchmarks.host_cost --device cpu --rounds 5
