#!/usr/bin/env bash
# Runs the OpenAI-client compatibility tests against a running `moeshard serve`.
#   tools/server-tests/run.sh http://127.0.0.1:PORT MODEL_ID [pytest args...]
# The virtual environment lives in $MOESHARD_CACHE/venv-server (default <repo>/.cache) and is
# rebuilt whenever requirements.txt changes. Any setup failure is a failure (exit non-zero).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
[ $# -ge 2 ] || { echo "usage: $0 BASE_URL MODEL_ID [pytest args...]" >&2; exit 2; }
url="$1"; model="$2"; shift 2
cache="${MOESHARD_CACHE:-$repo/.cache}"
venv="$cache/venv-server"
command -v curl >/dev/null || { echo "curl is required" >&2; exit 1; }
if ! [ -x "$venv/bin/python" ] || ! cmp -s "$here/requirements.txt" "$venv/requirements.txt"; then
    echo "creating $venv" >&2
    rm -rf "$venv"
    mkdir -p "$cache"
    python3 -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -r "$here/requirements.txt"
    cp "$here/requirements.txt" "$venv/requirements.txt"
fi
export MOESHARD_SERVER_URL="$url" MOESHARD_SERVER_MODEL="$model"
exec "$venv/bin/python" -m pytest -q -p no:cacheprovider "$here/test_openai.py" "$@"
