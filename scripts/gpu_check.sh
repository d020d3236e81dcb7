#!/usr/bin/env bash
# On a machine with a GPU: the gpu tier (tests/gpu), then the GPU timing, which writes
# benchmarks/results/gpu.md (a lossy-hook DDP step of a CUDA model against plain DDP; staging
# per MB). Run it as root: the tier's scenario test needs network namespaces. Its output is what
# a note on the work quotes. PYTHON: an interpreter with the project and a torch built with
# CUDA (default: .venv/bin/python). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}

"$PYTHON" - <<'PY'
import sys
import torch
if not torch.cuda.is_available():
    sys.exit("gpu_check: needs CUDA (torch.cuda.is_available() is False); "
             f"torch {torch.__version__}, CUDA {torch.version.cuda}")
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, "
      f"{torch.cuda.device_count()} GPU(s): {torch.cuda.get_device_name(0)}")
PY

tier=0
"$PYTHON" -m pytest -m gpu tests/gpu -rs -p no:cacheprovider "$@" || tier=$?
"$PYTHON" -m benchmarks.gpu  # timed even when a test failed: both are worth the GPU's minutes
exit "$tier"
