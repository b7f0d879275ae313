#!/usr/bin/env bash
# One prepared GPU check for the device tool (a lent machine with its own CUDA build of torch and no network):
# it uses that machine's python3 and torch, installs what is missing there from wheels carried in .whl/ (fetch them
# here first: `pip download --no-deps --only-binary=:all: --python-version 3.12 ... -d .whl gguf==0.19.0`), runs
# tests/gpu without the compiled CPU kernels (they are built for this host's Python; the CUDA paths never use
# them) and keeps the log in $OUT. Usage on the device tool: carry [".whl"], command `bash tests/gpu/run.sh`.
# Arguments replace tests/gpu: `bash tests/gpu/run.sh tests/integration/test_server.py` runs the CPU suite's server
# tests there, where device auto is the GPU (with fastapi, uvicorn, openai and llguidance among the wheels).
set -uo pipefail
cd "$(dirname "$0")/../.."
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .whl/*.whl 2>&1 | tail -2
fi
export PYTHONUNBUFFERED=1 WARMSTART_NO_NATIVE_KERNELS=1 WARMSTART_CACHE_DIR=/tmp/wscache
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
python3 -m pytest -q -p no:cacheprovider --timeout 300 -rs "${@:-tests/gpu}" 2>&1 | tee "${OUT:-/tmp}/gpu.log"
