#!/usr/bin/env bash
# The architecture sweep against the newest transformers on the package index (or VERSION), beside
# the pinned one from requirements-test.txt, and what changed: new architectures, dropped ones, new
# failures. Outside CI on purpose: CI runs the pinned versions only, so a release upstream never
# turns it red by itself. Moving the pin afterwards is a deliberate commit (see requirements-test.txt).
#
#   bash scripts/newest.sh            # the newest transformers
#   bash scripts/newest.sh 5.17.0     # a given release (e.g. the GPU machine's)
#
# The other transformers and its own dependencies go into .newest/ (git-ignored) with
# `pip install --target`, first on the sweep's path; .venv is left as it is.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
SPEC="transformers${1:+==$1}"
rm -rf .newest
echo "newest: installing $SPEC into .newest/"
.venv/bin/python -m pip install --disable-pip-version-check -q --target .newest --upgrade "$SPEC"
exec .venv/bin/python scripts/sweep_compare.py .newest --json .newest/sweeps.json
