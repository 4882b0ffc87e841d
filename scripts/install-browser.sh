#!/usr/bin/env bash
# Install a headless-capable Chromium for the dashboard tests (Debian/Ubuntu packages, no browser
# downloads from elsewhere). Idempotent: does nothing when a Chromium is already installed.
#
#   scripts/install-browser.sh            # installs /usr/bin/chromium if it is missing
#   STRATA_CHROMIUM=/path/to/chrome ...   # use that binary instead (checked, nothing installed)
set -euo pipefail

found() {
    local bin
    for bin in "${STRATA_CHROMIUM:-}" /usr/bin/chromium /usr/bin/chromium-browser /usr/bin/google-chrome; do
        if [ -n "$bin" ] && [ -x "$bin" ]; then
            echo "$bin"
            return 0
        fi
    done
    return 1
}

if bin=$(found); then
    echo "install-browser: using $bin ($("$bin" --version 2>/dev/null || echo 'version unknown'))"
    exit 0
fi

if ! command -v apt-get >/dev/null 2>&1; then
    echo "install-browser: no Chromium found and no apt-get here; install Chromium and set STRATA_CHROMIUM" >&2
    exit 1
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1; then
        SUDO="sudo"
    else
        echo "install-browser: need root (or sudo) to apt-get install chromium" >&2
        exit 1
    fi
fi

export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
# Debian names the package "chromium"; Ubuntu's "chromium-browser" is a snap shim, tried last.
if ! $SUDO apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core >/dev/null; then
    $SUDO apt-get install -y -qq --no-install-recommends chromium-browser >/dev/null
fi

if bin=$(found); then
    echo "install-browser: installed $bin ($("$bin" --version 2>/dev/null || echo 'version unknown'))"
else
    echo "install-browser: apt-get finished but no Chromium binary was found" >&2
    exit 1
fi
