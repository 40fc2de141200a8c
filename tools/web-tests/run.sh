#!/usr/bin/env bash
# Runs the built-in page's browser test (test_page.py) against a running `moeshard serve`:
#   tools/web-tests/run.sh BASE_URL [SCREENSHOT_DIR]
# Needs Chromium and its WebDriver (install-browser.sh installs them where it can, else this
# fails). The virtual environment lives in $MOESHARD_CACHE/venv-web (default <repo>/.cache) and
# is rebuilt whenever requirements.txt changes. Any setup failure is a failure (exit non-zero).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
[ $# -ge 1 ] || { echo "usage: $0 BASE_URL [SCREENSHOT_DIR]" >&2; exit 2; }
url="$1"
shots="${2:-}"

"$here/install-browser.sh"
browser="$(command -v chromium)"
driver="$(command -v chromedriver)"

cache="${MOESHARD_CACHE:-$repo/.cache}"
venv="$cache/venv-web"
if ! [ -x "$venv/bin/python" ] || ! cmp -s "$here/requirements.txt" "$venv/requirements.txt"; then
    echo "creating $venv" >&2
    rm -rf "$venv"
    mkdir -p "$cache"
    python3 -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -r "$here/requirements.txt"
    cp "$here/requirements.txt" "$venv/requirements.txt"
fi
export MOESHARD_SERVER_URL="$url" MOESHARD_BROWSER="$browser" MOESHARD_CHROMEDRIVER="$driver"
export MOESHARD_SCREENSHOT_DIR="$shots"
exec "$venv/bin/python" "$here/test_page.py"
