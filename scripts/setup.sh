#!/usr/bin/env bash
# Sets up this checkout's .venv: torch (only when none is importable), the tests' and the demo's
# packages at the versions pinned in requirements-test.txt, and offtensor itself with its native
# extension. Safe to run again: each step is skipped when already done.
#
# - torch is never upgraded or replaced. When python3 already has torch (the GPU machine's
#   2.11+cu130), .venv is made to see python3's packages instead of getting a second torch, and
#   without a pip or setuptools of its own, which would shadow python3's newer ones.
# - A package is installed only when it is missing or older than its floor (scripts/deps.py), so a
#   python3 that already holds them needs no package index at all (PIP_NO_INDEX=1 works). Wheels in
#   .whl/ (git-ignored; see benchmarks/gpu_suite.sh) are used before any index. Optional packages
#   (matplotlib, tqdm, ninja) that cannot be installed are reported and skipped.
# - offtensor is built in place (`setup.py build_ext --inplace`, against the torch found, never in
#   an isolated build environment) and made importable with a .pth file: what
#   `pip install --no-build-isolation -e .` does, with no need for a new setuptools or `wheel`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

TORCH_REQUIREMENT="torch==2.13.0"
LOCK="$PWD/requirements-test.txt"
export MAX_JOBS="${MAX_JOBS:-2}"
case "${OFFTENSOR_NO_NATIVE:-}" in
  "" | 0 | false | no) NO_NATIVE=0 ;;
  *) NO_NATIVE=1 ;;
esac

# Runs a command with its output kept out of the way, and shown in full if it fails.
quietly() {
  local log status
  log="$(mktemp)"
  if "$@" >"$log" 2>&1; then
    rm -f "$log"
  else
    status=$?
    echo "scripts/setup.sh: failed (exit $status): $*" >&2
    cat "$log" >&2
    rm -f "$log"
    return "$status"
  fi
}

if [ ! -x .venv/bin/python ]; then
  if SYSTEM_TORCH="$(python3 -c 'import torch, os; print(os.path.dirname(os.path.dirname(torch.__file__)))' 2>/dev/null)"; then
    echo "setup: python3 already has torch ($SYSTEM_TORCH): creating .venv that sees python3's packages"
    quietly python3 -m venv --system-site-packages --without-pip .venv
    if ! .venv/bin/python -c 'import torch' >/dev/null 2>&1; then
      # python3 is itself a venv (or similar), whose packages --system-site-packages does not reach:
      # add its torch's directory (its pip and setuptools too) at the end of .venv's path.
      .venv/bin/python -c 'import site, sys; open(site.getsitepackages()[0] + "/offtensor-python3-site.pth", "w").write(sys.argv[1] + "\n")' "$SYSTEM_TORCH"
    fi
  else
    echo "setup: creating .venv"
    quietly python3 -m venv .venv
  fi
fi
PY="$PWD/.venv/bin/python"
WHEELS=()
if [ -d .whl ]; then WHEELS=(--find-links "$PWD/.whl"); fi
pip() {
  if ! "$PY" -m pip --version >/dev/null 2>&1; then
    echo "scripts/setup.sh: $* needs pip, and neither .venv nor python3 has it" >&2
    return 1
  fi
  "$PY" -m pip --disable-pip-version-check "$@"
}

if ! "$PY" -c 'import torch' >/dev/null 2>&1; then
  echo "setup: installing $TORCH_REQUIREMENT"
  quietly pip install ${WHEELS[@]+"${WHEELS[@]}"} -c "$LOCK" "$TORCH_REQUIREMENT"
fi
TORCH_VERSION="$("$PY" -c 'import importlib.metadata as m; print(m.version("torch"))')"
CONSTRAINTS="$(mktemp)"
trap 'rm -f "$CONSTRAINTS"' EXIT
echo "torch==$TORCH_VERSION" >"$CONSTRAINTS"  # no later step may change torch

# Only what is missing or too old, each at its pin, every dependency pinned by the lock too.
REQUIRED="$("$PY" scripts/deps.py missing required)"
if [ -n "$REQUIRED" ]; then
  echo "setup: installing $REQUIRED"
  # shellcheck disable=SC2086  # one word per requirement
  if ! quietly pip install ${WHEELS[@]+"${WHEELS[@]}"} -c "$LOCK" -c "$CONSTRAINTS" $REQUIRED; then
    echo "scripts/setup.sh: the tests need $REQUIRED (missing or older than the floors in requirements-test.txt)," \
      "and pip could not install them; without a package index, install them into python3 or put their wheels in .whl/" >&2
    exit 1
  fi
fi
OPTIONAL="$("$PY" scripts/deps.py missing optional)"
if [ -n "$OPTIONAL" ]; then
  echo "setup: installing the optional $OPTIONAL"
  # No retries: a machine that reaches no index (the GPU one) skips them at once instead of waiting.
  # shellcheck disable=SC2086
  if ! pip install -q --retries 0 --timeout 15 ${WHEELS[@]+"${WHEELS[@]}"} -c "$LOCK" -c "$CONSTRAINTS" $OPTIONAL >/dev/null 2>&1; then
    echo "setup: could not install the optional $OPTIONAL: plots, progress bars, the parallel build or the client tests are skipped"
  fi
fi

SITE="$("$PY" -c 'import site; print(site.getsitepackages()[0])')"
build() {
  echo "setup: building offtensor (torch $TORCH_VERSION, MAX_JOBS=$MAX_JOBS)"
  if [ "$NO_NATIVE" = 0 ]; then
    quietly "$PY" setup.py build_ext --inplace
  fi
  echo "$PWD" >"$SITE/offtensor-checkout.pth"  # this checkout's offtensor, as an editable install
  built=1
}

extension_works() {
  "$PY" -c 'import torch, offtensor._C
cuda = "with" if torch.ops.offtensor.cuda_compiled() else "without"
print(f"setup: ok (torch {torch.__version__}, offtensor._C {cuda} its CUDA part)")'
}

# Rebuild offtensor only when it is not importable from this checkout or its native sources changed.
built=0
extension="$(ls offtensor/_C.*.so 2>/dev/null | head -n 1 || true)"
# Asked from / so that the checkout itself is not on the path; the path asked about is spelled
# before the `cd`, inside the subshell $PWD would already be /.
here="$PWD/offtensor/__init__.py"
installed_here="$(cd / && "$PY" -c 'import importlib.util, os, sys; s = importlib.util.find_spec("offtensor"); print(s is not None and os.path.realpath(s.origin) == os.path.realpath(sys.argv[1]))' "$here")"
if [ "$installed_here" != True ] || { [ "$NO_NATIVE" = 0 ] && {
     [ -z "$extension" ] || [ -n "$(find csrc setup.py -newer "$extension" -print -quit)" ]; }; }; then
  build
fi

if [ "$NO_NATIVE" = 1 ]; then
  echo "setup: OFFTENSOR_NO_NATIVE is set, so offtensor runs without its native extension"
elif ! extension_works 2>/dev/null; then
  # Up to date with its sources, yet it does not load: e.g. built against another torch.
  if [ "$built" = 0 ]; then build; fi
  if ! extension_works; then
    echo "scripts/setup.sh: offtensor was built but its native extension does not import (see above)" >&2
    exit 1
  fi
fi
