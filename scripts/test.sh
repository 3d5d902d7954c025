#!/usr/bin/env bash
# The test command: sets up .venv if needed (scripts/setup.sh), then runs pytest on tests/.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -k copy_engine -x`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q tests "$@"
