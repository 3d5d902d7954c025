#!/usr/bin/env bash
# The whole GPU verdict in one device call (at most 540 s on a fresh H200), or, with
# OFFTENSOR_SUITE_DRY=1, the same script on the emulated device of a CPU machine.
#
#   OUT=/tmp/out bash benchmarks/gpu_suite.sh                  # on the GPU machine
#   OFFTENSOR_SUITE_DRY=1 OUT=/tmp/out bash benchmarks/gpu_suite.sh   # here, emulated device
#
# - Python: the machine's own python3 with its torch (2.11+cu130 there); no venv, no download.
#   (Dry runs, and PYTHON=..., may use another: here .venv/bin/python, since python3 has no torch.)
# - Packages the GPU machine lacks travel as wheels in .whl/ (git-ignored), named in the call's
#   `carry`, and are installed into a temporary --target with --no-index. The list is short on
#   purpose: WHEELS below. To fetch them (here, once; the device tool's README has the recipe):
#       bash benchmarks/gpu_suite.sh --fetch-wheels
# - Time: a global deadline (OFFTENSOR_SUITE_DEADLINE, default 530 s from the start) caps every
#   step's own timeout; a step that no longer fits is recorded as skipped. Most valuable first:
#   build, 30 s probe, the native-error check, core tests on the device, paging benchmark, small
#   demo, then the rest. A first call on a fresh H200 reaches the MoE benchmark near its deadline;
#   a second call runs what is left (OFFTENSOR_SUITE_ONLY="probe bench_moe_host bench_moe bench_policy_host bench_load demo
#   bench_wrap opinfo").
# - Output under $OUT (at most 8 files come back from the device machine): suite.log gets every
#   step's output as it runs (tee), summary.json is rewritten before and after every step, so a
#   killed step still leaves its log and a summary that says "running". The probe's and the
#   benchmarks' JSON are embedded in summary.json, and all their files (JSON, PNG) are packed into
#   results.tgz after every step: four files in all, whatever the benchmarks write.
# - OFFTENSOR_SUITE_ONLY="step step ...": run only those steps (build always), for a second call
#   that picks up where a first one hit its deadline.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

# expecttest: torch.testing._internal and torch.library.opcheck import it. torchao (no dependencies,
# abi3): the quantised-weight tests on cuda (tests/test_quantized.py skips without it).
WHEELS=("$(grep -o "^expecttest==[^ ]*" requirements-test.txt)" "$(grep -o "^torchao==[^ ]*" requirements-test.txt)")
if [ "${1:-}" = "--fetch-wheels" ]; then
  grep -qx '/.whl/' .gitignore || echo '/.whl/' >>.git/info/exclude
  exec python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "${WHEELS[@]}"
fi

START=$SECONDS
DEADLINE=${OFFTENSOR_SUITE_DEADLINE:-530}
OUT="${OUT:-$(mktemp -d)}"
mkdir -p "$OUT"
STATE=$(mktemp -d)
RESULTS=$(mktemp -d)  # the benchmarks' own files; packed into $OUT/results.tgz after every step
: >"$OUT/suite.log"
: >"$STATE/steps.tsv"
export PYTHONUNBUFFERED=1 MAX_JOBS="${MAX_JOBS:-16}"

case "${OFFTENSOR_SUITE_DRY:-}" in "" | 0 | false | no) DRY=0 ;; *) DRY=1 ;; esac
PY="${PYTHON:-python3}"
if [ "$DRY" = 1 ] && [ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ]; then PY="$ROOT/.venv/bin/python"; fi
if [ "$DRY" = 1 ]; then
  DEVICE=cpu
  MAX_JOBS=2
else
  DEVICE=$($PY -c 'import torch; print("cuda" if torch.cuda.is_available() else "cpu")' 2>/dev/null || echo none)
fi
export OFFTENSOR_TEST_DEVICE="$DEVICE"

# Writes summary.json from the steps so far; cheap (no torch import), so it runs around every step.
summary() {
  tar czf "$OUT/.results.tgz.tmp" -C "$RESULTS" . 2>/dev/null && mv "$OUT/.results.tgz.tmp" "$OUT/results.tgz"
  "$PY" - "$STATE/steps.tsv" "$OUT" "$DEVICE" "$DRY" "$DEADLINE" "$((SECONDS - START))" "$RESULTS" <<'EOF' || true
import json, os, sys
steps_file, out, device, dry, deadline, elapsed, results = sys.argv[1:]
steps = []
current = os.path.join(os.path.dirname(steps_file), "current")
lines = list(open(steps_file)) + (list(open(current)) if os.path.exists(current) else [])
for line in lines:
    name, status, rc, seconds, limit, command = line.rstrip("\n").split("\t")
    steps.append({"step": name, "status": status, "rc": None if rc == "" else int(rc),
                  "seconds": int(seconds), "limit_s": int(limit), "command": command})
figures = {}
for name in sorted(os.listdir(results)):
    if name.endswith(".json"):
        try:
            figures[name] = json.load(open(os.path.join(results, name)))
        except (OSError, ValueError) as error:
            figures[name] = f"unreadable: {error}"
summary = {"device": device, "dry_run": dry == "1", "deadline_s": int(deadline), "elapsed_s": int(elapsed),
           "steps": steps, "figures": figures}
machine = os.path.join(out, "machine.txt")
if os.path.exists(machine):
    summary["machine"] = open(machine).read().splitlines()
tmp = os.path.join(out, ".summary.json.tmp")
with open(tmp, "w") as f:
    json.dump(summary, f, indent=1, default=str)
os.replace(tmp, os.path.join(out, "summary.json"))
EOF
}

# step NAME LIMIT_S COMMAND...: run within min(LIMIT_S, time left), output teed into suite.log live.
step() {
  local name=$1 limit=$2; shift 2
  if [ -n "${OFFTENSOR_SUITE_ONLY:-}" ] && [[ " build wheels $OFFTENSOR_SUITE_ONLY " != *" $name "* ]]; then
    return 0  # a second call runs only the steps the first one did not reach
  fi
  local left=$((DEADLINE - (SECONDS - START) - 3))  # 3 s to write the last summary
  if [ "$left" -lt 10 ]; then
    printf '%s\tskipped: deadline\t\t0\t0\t%s\n' "$name" "$*" >>"$STATE/steps.tsv"
    echo "===== $name: skipped, $left s left before the deadline" | tee -a "$OUT/suite.log"
    summary
    return 1
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  local start=$SECONDS
  # Listed as running while it runs: if the whole call is killed now, the summary says which step.
  printf '%s\trunning\t\t0\t%s\t%s\n' "$name" "$limit" "$*" >"$STATE/current"
  summary
  rm -f "$STATE/current"
  echo "===== $name ($DEVICE, limit ${limit}s, $((SECONDS - START))s into the suite): $*" | tee -a "$OUT/suite.log"
  timeout --kill-after=5 "$limit" "$@" 2>&1 | tee -a "$OUT/suite.log"
  local rc=${PIPESTATUS[0]}
  local status=ok
  [ "$rc" != 0 ] && status=failed
  { [ "$rc" = 124 ] || [ "$rc" = 137 ]; } && status=timeout
  printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "$status" "$rc" "$((SECONDS - start))" "$limit" "$*" >>"$STATE/steps.tsv"
  echo "===== $name: $status (rc=$rc, $((SECONDS - start))s)" | tee -a "$OUT/suite.log"
  summary
  return "$rc"
}

{ echo "date: $(date -u +%FT%TZ)"; echo "dry run: $DRY, device: $DEVICE, python: $PY"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
  $PY -c 'import torch, platform; print("torch", torch.__version__, "cuda", torch.version.cuda, platform.platform())'
  nproc; free -g 2>/dev/null | sed -n 2p
} >"$OUT/machine.txt" 2>&1
summary

# Carried wheels: into a throwaway --target, never into the machine's python.
if compgen -G ".whl/*.whl" >/dev/null; then
  SITE=$(mktemp -d)
  if step wheels 60 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
      .whl/*.whl; then
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
  else
    # No pip there: pure-Python wheels (expecttest is one) import straight from the zip file.
    for wheel in "$ROOT"/.whl/*.whl; do PYTHONPATH="$wheel${PYTHONPATH:+:$PYTHONPATH}"; done
    export PYTHONPATH
  fi
fi

# Build in place (the tests import offtensor from this checkout), unless an extension newer than
# every native source already imports.
build() {
  local so
  so=$(ls offtensor/_C.*.so 2>/dev/null | head -n 1)
  if [ -n "$so" ] && [ -z "$(find csrc setup.py -newer "$so" -print -quit)" ] && \
     "$PY" -c 'import torch, offtensor._C' 2>/dev/null; then
    echo "offtensor._C is up to date: $so"
    return 0
  fi
  "$PY" setup.py -q build_ext --inplace
}
export -f build
export PY
step build 240 bash -c build

step probe 30 "$PY" benchmarks/gpu_probe.py --device "$DEVICE" --out "$RESULTS"

# Why the extension's own C++ errors crashed the process on the H200 (SIGSEGV at every TORCH_CHECK
# that fired in offtensor._C) while torch's became exceptions: each scenario in its own process,
# with a native backtrace from a crash (benchmarks/native_errors.py; about a minute).
# (Dry runs skip it: tests/test_native_errors.py runs it on the CPU machine.)
if [ "$DRY" = 0 ]; then step native_errors 120 "$PY" benchmarks/native_errors.py --out "$RESULTS"; fi

# Test steps run on pytest-xdist workers where the machine has it (the GPU machine does): a test that
# kills its process is reported as a crashed worker and the rest still run, with -v lines in the log
# as each test ends. pytest-timeout, where present, fails a hung test instead of the whole step.
PYTEST=("$PY" -m pytest -p no:cacheprovider -rfE)
if [ "$DRY" = 0 ] && "$PY" -c "import xdist" 2>/dev/null; then PYTEST+=(-v -n "${OFFTENSOR_SUITE_WORKERS:-8}"); else PYTEST+=(-q); fi
if "$PY" -c "import pytest_timeout" 2>/dev/null; then PYTEST+=(--timeout 90); fi

# The core files and the paths one GPU can run of other tensor subclasses: casts, quantised
# (torchao) and wrapper-subclass weights.
SEMANTICS=(tests/test_semantics.py tests/test_semantics_writes.py tests/test_semantics_copies.py tests/test_semantics_saving.py
           tests/test_semantics_autograd.py tests/test_semantics_torch_function.py)
WRAP=(tests/test_wrap.py tests/test_wrap_budget.py tests/test_wrap_unwrap.py tests/test_wrap_experts.py)
CORE=(tests/test_ext.py tests/test_pager.py "${SEMANTICS[@]}" "${WRAP[@]}" tests/test_models.py)
SUBCLASS=(tests/test_casts.py tests/test_quantized.py tests/test_working_sets.py tests/test_subclass_leaves.py)
step core_tests 200 "${PYTEST[@]}" "${CORE[@]}" "${SUBCLASS[@]}"

step bench_paging 120 "$PY" benchmarks/paging.py --device "$DEVICE" --out "$RESULTS" --repeats 3

step demo_small 90 "$PY" -m offtensor demo --device "$DEVICE" --size small --tokens 16

# The schedule against the PCIe bound and the other offloaders.
step bench_offload 150 "$PY" benchmarks/offload_bench.py --device "$DEVICE" --out "$RESULTS"

# The rest, most useful first, as far as the deadline allows.
IGNORE=(--ignore tests/test_gpu_suite.py)  # this suite's own dry run
for f in "${CORE[@]}" "${SUBCLASS[@]}"; do IGNORE+=(--ignore "$f"); done
step other_tests 200 "${PYTEST[@]}" -m "not opinfo" tests "${IGNORE[@]}"
step bench_vllm 90 "$PY" benchmarks/vllm_path.py --device "$DEVICE" --out "$RESULTS"
step bench_dispatch 60 "$PY" benchmarks/dispatch.py --device "$DEVICE" --out "$RESULTS"
if [ "$DRY" = 0 ]; then
  # The MoE look-ahead's verdict: the H200 replay of the trained models' decode under the host
  # figures the probe just measured, against the committed ones (two sets; ~2 min a model here).
  step bench_moe_host 200 "$PY" benchmarks/moe_host_sensitivity.py --host-from "$RESULTS/probe.json" --sets 2 \
    --models qwen3 mixtral --out "$RESULTS"
  # A pooled MoE decode (expert_pool=True) eager and captured in a CUDA graph, tok/s against the
  # resident model, a UVA-style offload at the same budget (experts read in place from pinned
  # memory, as vLLM's cpu_offload) and today's wrapped path, alternating; tokens checked against
  # the resident ones; a variant that fails is recorded with its error (~1 min).
  step bench_pool_graph 90 "$PY" benchmarks/pool_graph_decode.py --device "$DEVICE" --out "$RESULTS"
  # The 15 GB Qwen3-MoE at a 4 GiB budget against resident, copy-all, accelerate and UVA (3-5 min:
  # usually a second call, OFFTENSOR_SUITE_ONLY="bench_moe ...").
  step bench_moe 300 "$PY" benchmarks/moe_bench.py --device "$DEVICE" --out "$RESULTS" --budget-gb 4
  # The expert policy's host time on this machine's host (the replay does not charge it yet; the
  # emulated device, so only the host's speed counts; about a minute).
  step bench_policy_host 120 "$PY" benchmarks/moe_policy_host.py --models qwen3 mixtral --repeats 2 --out "$RESULTS" \
    --name moe_policy_host_gpu_machine.json
  step bench_load 240 "$PY" benchmarks/load_bench.py --device "$DEVICE" --out "$RESULTS" --layers 16 --hidden 2048 --repeats 2
  step demo 150 "$PY" -m offtensor demo --device "$DEVICE"
  step bench_wrap 150 "$PY" benchmarks/wrap_overhead.py --device "$DEVICE" --out "$RESULTS"
  # An in-place step in slices of a weight larger than the room, with and without the host copy
  # that makes it all or nothing: on a GPU the slices cross PCIe while the copy is the host's.
  step bench_write_slices 60 "$PY" benchmarks/write_slices.py --device "$DEVICE" --out "$RESULTS" --mib 256
  step opinfo 240 "${PYTEST[@]}" -m opinfo tests/test_opinfo.py tests/test_opinfo_tight.py
fi

echo
echo "offtensor gpu suite on $DEVICE in $((SECONDS - START)) s (deadline $DEADLINE s); logs and JSON in $OUT"
cat "$OUT/machine.txt"
awk -F'\t' '{ printf "%-16s %-18s rc=%-4s %4ss (limit %ss)\n", $1, $2, $3, $4, $5 }' "$STATE/steps.tsv"
summary
rm -rf "$STATE" "$RESULTS"
exit 0
