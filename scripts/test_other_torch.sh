#!/usr/bin/env bash
# Run the test suite against another torch release than CI's 2.13.0, in a virtual environment of its own:
#   bash scripts/test_other_torch.sh 2.11.0 [pytest args...]
# Tessera supports torch >= 2.11 (the GPU machine runs 2.11). From PyPI, torch releases other than the CPU
# build CI uses come as CUDA builds (about 4.5 GB with their NVIDIA packages); they run the CPU tests as well.
set -euo pipefail
version=${1:?usage: scripts/test_other_torch.sh TORCH_VERSION [pytest args...]}
shift
cd "$(dirname "$0")/.."
venv=${VENV:-/tmp/tessera-torch-$version}
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/pip" install -q "torch==$version"
"$venv/bin/pip" install -q -e '.[dev]'
"$venv/bin/python" -c "import torch; print('torch', torch.__version__)"
"$venv/bin/python" -m pytest -q "$@"
