#!/usr/bin/env bash
# One prepared GPU check for the device tool (a lent machine with its own CUDA build of torch and no network):
# it uses that machine's python3 and torch, installs what is missing there from wheels carried in .whl/, runs
# tests/gpu without the compiled CPU kernels (they are built for this host's Python; the CUDA paths never use
# them) and keeps the log in $OUT. Usage on the device tool: carry [".whl"], command `bash tests/gpu/run.sh`.
# Arguments replace tests/gpu: `bash tests/gpu/run.sh tests/integration/test_server.py` runs the CPU suite's server
# tests there, where device auto is the GPU.
# The wheels (Python 3.12, versions as requirements.lock; echo /.whl/ >> .git/info/exclude first), fetched here with
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_31_x86_64 -d .whl NAME==V
# tests/gpu: gguf pydantic pydantic_core annotated-types typing-inspection; the server tests add fastapi starlette
# uvicorn annotated-doc opentelemetry-api openai jiter distro httpx2 httpcore2 truststore idna anyio h11 sniffio
# typing_extensions llguidance (~10 MB in all; seen on 2026-12-04, torch 2.11.0+cu130 there).
set -uo pipefail
cd "$(dirname "$0")/../.."
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .whl/*.whl 2>&1 | tail -2
fi
export PYTHONUNBUFFERED=1 WARMSTART_NO_NATIVE_KERNELS=1 WARMSTART_CACHE_DIR=/tmp/wscache
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
python3 -m pytest -q -p no:cacheprovider --timeout 300 -rs "${@:-tests/gpu}" 2>&1 | tee "${OUT:-/tmp}/gpu.log"
