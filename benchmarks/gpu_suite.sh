#!/usr/bin/env bash
# One call on the GPU machine: build the extension, run the test suite on the device, run the
# benchmarks, leave JSON + logs under $OUT, print a short table last.
#
#   OUT=/tmp/out bash benchmarks/gpu_suite.sh          # also works on a CPU-only machine
#
# The GPU machine has torch, transformers, safetensors, pytest and hypothesis installed and no
# network, so nothing is installed here: the extension is built against the torch already there.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$(mktemp -d)}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
if [ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ]; then PY=.venv/bin/python; fi
export PYTHONUNBUFFERED=1 MAX_JOBS="${MAX_JOBS:-8}"
DEVICE=$($PY -c 'import torch; print("cuda" if torch.cuda.is_available() else "cpu")')
export OFFTENSOR_TEST_DEVICE="$DEVICE"
declare -A STATUS

# Only 8 files come back from the device machine: one log for all steps, JSON beside it.
LOGS=$(mktemp -d)
step() {  # step NAME TIMEOUT_S COMMAND... : run, log, remember the exit code and duration
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  echo "=== $name ($DEVICE): $*"
  timeout "$limit" "$@" >"$LOGS/$name.log" 2>&1
  local rc=$?
  STATUS[$name]="rc=$rc $((SECONDS - start))s"
  { echo "===== $name: $* (rc=$rc)"; cat "$LOGS/$name.log"; } >>"$OUT/suite.log"
  tail -n 5 "$LOGS/$name.log"
  return $rc
}

{ echo "date: $(date -u +%FT%TZ)"; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
  $PY -c 'import torch, platform; print("torch", torch.__version__, "cuda", torch.version.cuda, platform.platform())'
} >"$OUT/machine.txt" 2>&1

step build 300 $PY -m pip install --no-build-isolation --no-deps -q -e . || \
  step build_inplace 300 $PY setup.py build_ext --inplace
step tests 420 $PY -m pytest -q -p no:cacheprovider tests
step bench_dispatch 120 $PY benchmarks/dispatch.py --device "$DEVICE" --out "$OUT"
if [ -f benchmarks/wrap_overhead.py ]; then
  step bench_wrap 240 $PY benchmarks/wrap_overhead.py --device "$DEVICE" --out "$OUT"
fi
step bench_paging 240 $PY benchmarks/paging.py --device "$DEVICE" --out "$OUT"
step demo 300 $PY -m offtensor demo --device "$DEVICE"

echo
echo "offtensor gpu suite on $DEVICE  (logs and JSON in $OUT)"
cat "$OUT/machine.txt"
printf '%-16s %s\n' step status
for name in build build_inplace tests bench_dispatch bench_wrap bench_paging demo; do
  [ -n "${STATUS[$name]:-}" ] && printf '%-16s %s\n' "$name" "${STATUS[$name]}"
done
grep -E "passed|failed" "$LOGS/tests.log" | tail -n 1
[ -f "$LOGS/bench_dispatch.log" ] && grep -E "^(op |F.linear|add|t \(view\))" "$LOGS/bench_dispatch.log"
[ -f "$LOGS/bench_paging.log" ] && grep -E "copy|dense|moe" "$LOGS/bench_paging.log"
[ -f "$LOGS/demo.log" ] && tail -n 15 "$LOGS/demo.log"
exit 0
