#!/usr/bin/env bash
# Create (or reuse) the project-local virtualenv .venv and install plait into it.
# torch is pinned and installed first, so pip never resolves it to a multi-GB CUDA build:
# on a CPU machine torch==2.13.0 is the CPU wheel.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install --quiet --disable-pip-version-check "torch==2.13.0" 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".[dev,digits]" 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -c "import torch, plait" # fail here, loudly, if the install did not work
