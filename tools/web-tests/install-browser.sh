#!/usr/bin/env bash
# Makes sure Chromium and its WebDriver are installed for the web page's browser test: when
# either is missing and this runs as root with apt-get (CI on Debian), installs Debian's
# `chromium` and `chromium-driver`; otherwise, if they are still missing, fails.
set -euo pipefail
have() { command -v chromium >/dev/null && command -v chromedriver >/dev/null; }
if ! have && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "installing chromium and chromium-driver with apt-get" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq chromium chromium-driver >/dev/null
fi
have || {
    echo "Chromium and chromedriver are required (Debian: apt-get install chromium chromium-driver)" >&2
    exit 1
}
