#!/usr/bin/env bash
# The one prepared run for a lent GPU machine (torch with CUDA, transformers, Triton and pytest installed; no
# downloads, no TRL, datasets, vLLM or flash-attn needed): logs and JSON to $OUT (default ./gpu_out).
#
#     bash benchmarks/gpu_session.sh
#
# Budget. A GPU command may run 600 s, and a session has 15 minutes of device time in all, the machine's start
# included: the parts' timeouts, each with its kill grace, add up to at most 480 s. The script prints the sum first
# and refuses to start (exit 2) when it is larger. A part's timeout can be set from the environment (T_PROBE,
# T_TESTS, T_SPEED, T_CHECK; KILL_GRACE: seconds between SIGTERM and SIGKILL).
#
# Parts, in order, each under its own timeout; each runs whatever the others did:
#   probe        nvidia-smi, the versions, whether torch sees a CUDA device
#   tests        the tests that only a GPU runs for real: tests/test_cuda_graphs.py (real captures of each step kind),
#                the Triton kernels and their self-checks (tests/test_kernels_triton.py, tests/test_gpu_self_check.py),
#                the graphs' static path (tests/test_graphs.py), flash-attn's packed attention and liger's GRPO run
#                (test_packed_attention.py, test_trl_compat.py: these skip, and say why, where flash-attn or TRL
#                and datasets are not installed), the capture tests that need a device (test_capture_rehearsal.py)
#   gpu_speed    benchmarks/gpu_speed.py: the arms (policy x dtype x batch x sampling) within the part's own
#                deadline, JSON after each arm (gpu_speed.json, gpu_speed_arms.jsonl)
#   self_checks  benchmarks/gpu_check.py --self-checks-only --quick: the Triton kernels' and CUDA graphs' first-use
#                self-checks with real captures, and their fallbacks with a wrong kernel and a corrupted graph injected
#
# Exit status:
#   0   every part ran and passed
#   1   a part failed or timed out; gpu_speed also fails when an arm fell back to eager (a graph self-check
#       failed), a TLT warning was logged, a self-check disagreed, or its budget cut required arms (summary.txt
#       says which)
#   2   the timeouts add up to more than 480 s: nothing was run
#   77  no CUDA device: nothing measured (every part says so; what a CPU smoke run of this script ends with)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_out}"
mkdir -p "$OUT"
# This checkout's package, whatever else is installed
export OUT PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# The GPU machine's interpreter is python3 (there may be no `python`)
PY=${PYTHON:-$(command -v python3 || command -v python)}

LIMIT=480
T_PROBE=${T_PROBE:-20}
T_TESTS=${T_TESTS:-150}
T_SPEED=${T_SPEED:-230}
T_CHECK=${T_CHECK:-60}
KILL_GRACE=${KILL_GRACE:-5}
PARTS=4
TOTAL=$((T_PROBE + T_TESTS + T_SPEED + T_CHECK + PARTS * KILL_GRACE))
echo "gpu_session: timeouts probe $T_PROBE + tests $T_TESTS + gpu_speed $T_SPEED + self_checks $T_CHECK s" \
     "+ $PARTS x $KILL_GRACE s kill grace = $TOTAL s (limit $LIMIT s)"
if [ "$TOTAL" -gt "$LIMIT" ]; then
    echo "gpu_session: REFUSED: the timeouts add up to $TOTAL s, more than $LIMIT s (a GPU command may run 600 s," \
         "and the session's 15 minutes include the machine's start): nothing was run"
    exit 2
fi

: > "$OUT/summary.txt"
PARTS_JSON=""
FAILED=0
SESSION_START=$SECONDS

record() {  # name, limit, rc, seconds, verdict, detail
    local line="$1: $5 (exit $3, $4 s of $2 s)${6:+: $6}"
    echo "$line" | tee -a "$OUT/summary.txt"
    local detail=${6//\\/\\\\}
    detail=${detail//\"/\\\"}
    PARTS_JSON+="${PARTS_JSON:+,}{\"part\": \"$1\", \"limit_s\": $2, \"kill_grace_s\": $KILL_GRACE, \"exit\": $3,"
    PARTS_JSON+=" \"seconds\": $4, \"verdict\": \"$5\", \"detail\": \"$detail\"}"
}

run() {  # name, seconds, command...: the command's output to $OUT/name.log
    local name=$1 seconds=$2
    shift 2
    local start=$SECONDS rc=0
    timeout -k "$KILL_GRACE" "$seconds" "$@" > "$OUT/$name.log" 2>&1 || rc=$?
    local took=$((SECONDS - start)) verdict
    case $rc in
        0) verdict=PASSED ;;
        124 | 137) verdict="TIMED OUT" ;;
        77) verdict="NOTHING MEASURED" ;;
        3) verdict="INCOMPLETE (its budget cut arms)" ;;
        *) verdict=FAILED ;;
    esac
    [ "$rc" -ne 0 ] && FAILED=1
    # The part's own last word: pytest's summary line, the scripts' final line
    local last
    last=$(grep -v '^\s*$' "$OUT/$name.log" | tail -n 1 | cut -c1-300)
    case $rc in 124 | 137) last="killed at its timeout; its last line: ${last:-(none)}" ;; esac
    record "$name" "$seconds" "$rc" "$took" "$verdict" "$last"
}

not_run() {  # name, seconds, reason
    record "$1" "$2" 77 0 "NOTHING MEASURED" "$3"
}

finish() {  # exit status
    local status=$1 verdict
    case $status in 0) verdict=PASSED ;; 77) verdict="NOTHING MEASURED: no CUDA device" ;; *) verdict=FAILED ;; esac
    echo "{\"exit\": $status, \"verdict\": \"$verdict\", \"timeouts_total_s\": $TOTAL, \"limit_s\": $LIMIT," \
         "\"seconds\": $((SECONDS - SESSION_START)), \"parts\": [$PARTS_JSON]}" > "$OUT/summary.json"
    echo "gpu_session: $verdict after $((SECONDS - SESSION_START)) s (timeouts $TOTAL s of $LIMIT s); logs and" \
         "JSON in $OUT" | tee -a "$OUT/summary.txt"
    exit "$status"
}

# ---------------------------------------------------------------------------------------------------- probe
# Everything here under the probe's timeout (nvidia-smi can hang on a broken driver). Only torch is imported, the
# others' versions come from their metadata: a cold first import must fit.
run probe "$T_PROBE" bash -c '
if nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1; then echo "nvidia-smi: yes"; else echo "nvidia-smi: no"; fi
"$0" - <<"PYTHON"
from importlib.metadata import PackageNotFoundError, version
from importlib.util import find_spec

import torch


def v(name):
    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


cuda = torch.cuda.is_available()
print("pytest-timeout: yes" if find_spec("pytest_timeout") else "pytest-timeout: no")
print("cuda: yes" if cuda else "cuda: no")
device = torch.cuda.get_device_name() if cuda else None
transformers, triton, pytest = (v(name) for name in ("transformers", "triton", "pytest"))
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), transformers {transformers}, triton {triton}, "
      f"pytest {pytest}; device: {device}")
PYTHON
' "$PY"
cp "$OUT/probe.log" "$OUT/versions.txt" 2>/dev/null
# A probe that failed or timed out says nothing: the parts run anyway (each checks for CUDA itself)
if grep -q '^cuda: no' "$OUT/probe.log"; then
    if grep -q '^nvidia-smi: yes' "$OUT/probe.log"; then  # a GPU answers, but this torch cannot use it: a failure
        echo "gpu_session: nvidia-smi sees a GPU but torch sees no CUDA device (a CPU build of torch, or a driver" \
             "mismatch): see nvidia-smi.txt and probe.log" | tee -a "$OUT/summary.txt"
        FAILED=1
    fi
    not_run tests "$T_TESTS" "no CUDA device: nothing measured"
    not_run gpu_speed "$T_SPEED" "no CUDA device: nothing measured"
    not_run self_checks "$T_CHECK" "no CUDA device: nothing measured"
    [ "$FAILED" -ne 0 ] && finish 1
    finish 77
fi

# ---------------------------------------------------------------------------------------------------- tests
TESTS=(tests/test_cuda_graphs.py tests/test_kernels_triton.py tests/test_gpu_self_check.py tests/test_graphs.py
       tests/test_packed_attention.py::test_flash_backend_equals_torch_backend
       tests/test_trl_compat.py::test_liger_kernel_same_outcome_as_stock
       tests/test_capture_rehearsal.py::test_catch_up_is_timed_on_the_device
       tests/test_capture_rehearsal.py::test_graphs_captured_under_autocast_replay_exactly_after_an_in_place_update)
# A file that fails to import is reported and the others still run; where pytest-timeout is installed (the GPU
# image has it), a test that hangs fails alone instead of taking the part's whole timeout with it
PYTEST=(-q -rs --no-header -p no:cacheprovider --continue-on-collection-errors --junitxml="$OUT/tests.xml")
grep -q '^pytest-timeout: yes' "$OUT/probe.log" && PYTEST+=(--timeout 60)
run tests "$T_TESTS" "$PY" -m pytest "${PYTEST[@]}" "${TESTS[@]}"

# ---------------------------------------------------------------------------------------------------- speed
# Its own deadline leaves 20 s of the part's timeout for the table and the final JSON
run gpu_speed "$T_SPEED" "$PY" benchmarks/gpu_speed.py --out-dir "$OUT" --deadline $(($(date +%s) + T_SPEED - 20))

# ---------------------------------------------------------------------------------------------------- self-checks
run self_checks "$T_CHECK" "$PY" benchmarks/gpu_check.py --self-checks-only --quick

finish "$FAILED"
