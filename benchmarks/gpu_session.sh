#!/usr/bin/env bash
# The one prepared run for a lent GPU machine (torch with CUDA, transformers, Triton and pytest installed; no
# downloads): the GPU test files, then the GPU checks and the speed script, each under a timeout, logs and result
# files to $OUT (default ./gpu_out). At most 10.5 minutes (the timeouts); each part runs whatever the others did.
#
#     bash benchmarks/gpu_session.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_out}"
mkdir -p "$OUT"
export OUT PYTHONUNBUFFERED=1
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
python -c "import torch, transformers; print(torch.__version__, torch.version.cuda, transformers.__version__)" \
    > "$OUT/versions.txt" 2>&1

run() {  # name, seconds, command...
    local name=$1 seconds=$2
    shift 2
    local start=$SECONDS rc=0
    timeout "$seconds" "$@" > "$OUT/$name.log" 2>&1 || rc=$?
    echo "$name: exit $rc after $((SECONDS - start)) s" | tee -a "$OUT/summary.txt"
}

run tests 180 python -m pytest -q -x --no-header -p no:cacheprovider tests/test_kernels_triton.py \
    tests/test_gpu_self_check.py tests/test_graphs.py tests/test_packed_attention.py tests/test_step_proxies.py
run gpu_speed 270 python benchmarks/gpu_speed.py
run gpu_check 180 python benchmarks/gpu_check.py --quick
cat "$OUT/summary.txt"
