#!/usr/bin/env bash
# Sets up this checkout's .venv: torch (only when none is importable), the test tools, and offtensor
# itself with its native extension. Safe to run again: each step is skipped when already done.
#
# torch is never upgraded or replaced: whatever torch the venv has is pinned for every later pip
# call, and offtensor builds against it without build isolation. When python3 already has torch
# (the GPU machine's 2.11+cu130), .venv is made to see python3's packages instead of getting a
# second torch. Wheels in .whl/ (git-ignored; see benchmarks/gpu_suite.sh) are used before any index.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

TORCH_REQUIREMENT="torch==2.13.0"
TEST_PACKAGES=(numpy pytest hypothesis safetensors transformers ninja expecttest accelerate tqdm matplotlib)  # each imports under its own name
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
    quietly python3 -m venv --system-site-packages .venv
    if ! .venv/bin/python -c 'import torch' >/dev/null 2>&1; then
      # python3 is itself a venv (or similar), whose packages --system-site-packages does not reach:
      # add its torch's directory at the end of .venv's path.
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
pip() { "$PY" -m pip --disable-pip-version-check "$@"; }

# setuptools 70.1 builds wheels (and editable installs) without the separate `wheel` package.
if ! "$PY" -c 'import setuptools, sys; sys.exit(tuple(map(int, setuptools.__version__.split(".")[:2])) < (70, 1))' 2>/dev/null; then
  echo "setup: upgrading setuptools"
  quietly pip install "setuptools>=70.1"
fi

if ! "$PY" -c 'import torch' >/dev/null 2>&1; then
  echo "setup: installing $TORCH_REQUIREMENT"
  quietly pip install "$TORCH_REQUIREMENT"
fi
TORCH_VERSION="$("$PY" -c 'import importlib.metadata as m; print(m.version("torch"))')"
CONSTRAINTS="$(mktemp)"
trap 'rm -f "$CONSTRAINTS"' EXIT
echo "torch==$TORCH_VERSION" >"$CONSTRAINTS"  # no later step may change torch

# find_spec, not import: importing transformers alone takes seconds.
if ! "$PY" -c "import importlib.util, sys; sys.exit(None in [importlib.util.find_spec(m) for m in sys.argv[1:]])" \
    "${TEST_PACKAGES[@]}"; then
  echo "setup: installing ${TEST_PACKAGES[*]}"
  quietly pip install ${WHEELS[@]+"${WHEELS[@]}"} -c "$CONSTRAINTS" "${TEST_PACKAGES[@]}"
fi

build() {
  echo "setup: building offtensor (torch $TORCH_VERSION, MAX_JOBS=$MAX_JOBS)"
  quietly pip install -c "$CONSTRAINTS" --no-build-isolation --no-deps -e .
  built=1
}

extension_works() {
  "$PY" -c 'import torch, offtensor._C
cuda = "with" if torch.ops.offtensor.cuda_compiled() else "without"
print(f"setup: ok (torch {torch.__version__}, offtensor._C {cuda} its CUDA part)")'
}

# Rebuild offtensor only when it is not installed from this checkout or its native sources changed.
built=0
extension="$(ls offtensor/_C.*.so 2>/dev/null | head -n 1 || true)"
installed_here="$("$PY" -c 'import importlib.util, os; s = importlib.util.find_spec("offtensor"); print(s is not None and os.path.realpath(s.origin) == os.path.realpath("offtensor/__init__.py"))')"
if [ "$installed_here" != True ] || { [ "$NO_NATIVE" = 0 ] && {
     [ -z "$extension" ] || [ -n "$(find csrc setup.py pyproject.toml -newer "$extension" -print -quit)" ]; }; }; then
  build
fi

if [ "$NO_NATIVE" = 1 ]; then
  echo "setup: OFFTENSOR_NO_NATIVE is set, so offtensor runs without its native extension"
elif ! extension_works 2>/dev/null; then
  # Up to date with its sources, yet it does not load: e.g. built against another torch.
  if [ "$built" = 0 ]; then build; fi
  if ! extension_works; then
    echo "scripts/setup.sh: offtensor was installed but its native extension does not import (see above)" >&2
    exit 1
  fi
fi
