#!/usr/bin/env bash
# The test command: sets up .venv if needed (scripts/setup.sh), then runs pytest on tests/.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -k copy_engine -x`; files, directories or
# test ids among them run instead of tests/ (`bash scripts/test.sh tests/test_wrap.py`): pytest
# itself tells them from options' values and falls back to pyproject.toml's testpaths without them.
#
# With pytest-xdist installed (an optional pin), the suite runs on OFFTENSOR_TEST_WORKERS processes
# (default: 2, or 1 on a 1-core machine), a test file per worker at a time (--dist loadfile: a
# file's module fixtures, such as a trained model, are built once). Most tests are one Python
# thread of dispatch, so two workers take a 2-core machine's suite from ~5.5 to ~3 minutes.
# OFFTENSOR_TEST_WORKERS=0, or -n/-p no:xdist among the arguments, runs in this process.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
workers="${OFFTENSOR_TEST_WORKERS:-$(( $(nproc 2>/dev/null || echo 2) >= 2 ? 2 : 0 ))}"
parallel=()
if [ "$workers" -gt 1 ] && [[ " $* " != *" -n "* && " $* " != *"no:xdist"* ]] && .venv/bin/python -c "import xdist" 2>/dev/null; then
  parallel=(-n "$workers" --dist loadfile)
fi
exec .venv/bin/python -m pytest -q "${parallel[@]}" "$@"
