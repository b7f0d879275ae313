#!/usr/bin/env bash
# One prepared GPU check for the device tool: build the venv there, run tests/gpu, keep the log in $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
python3 -m venv /tmp/venv && /tmp/venv/bin/pip install -q -r requirements.lock 2>&1 | tail -2
export PYTHONUNBUFFERED=1
/tmp/venv/bin/python -m pytest tests/gpu -q -x 2>&1 | tee "${OUT:-/tmp}/gpu.log"
