#!/usr/bin/env bash
# The README's demo: sets up .venv if needed (scripts/setup.sh), then generates with a DeepSeek-style
# MLA + MoE model under a device budget well below its weights and checks the tokens against the
# unwrapped model. Extra arguments go to the demo, e.g. `bash scripts/demo.sh --tokens 64 --size small`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
exec .venv/bin/python -m offtensor demo "$@"
