#!/usr/bin/env bash
# Create the Python venv used by tools/demo-model/*.py.
# Location: $MOESHARD_CACHE/venv-demo (default <repo>/.cache/venv-demo). Needs PyPI only.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
CACHE="${MOESHARD_CACHE:-$REPO/.cache}"
VENV="$CACHE/venv-demo"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null || PY=python3
if [[ ! -x "$VENV/bin/python" ]]; then
    "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install --upgrade pip==24.3.1
"$VENV/bin/python" -m pip install -r "$HERE/requirements.txt"
"$VENV/bin/python" - <<'PY'
import torch, transformers, tokenizers, numpy, matplotlib
print("torch", torch.__version__, "transformers", transformers.__version__,
      "tokenizers", tokenizers.__version__, "numpy", numpy.__version__,
      "matplotlib", matplotlib.__version__)
PY
echo "venv ready: $VENV"
