#!/usr/bin/env bash
# Installs everything the testbed needs on a fresh Debian bookworm machine, idempotently:
# Debian packages, a venv with the pinned torch and the project, and the cached UML kernel.
set -euo pipefail
cd "$(dirname "$0")/.."

APT_PACKAGES=(iproute2 nftables kmod iputils-ping ethtool patchelf ca-certificates prometheus)
VENV=${TESTBED_VENV:-.venv}
PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3

missing=()
for pkg in "${APT_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if ((${#missing[@]})); then
    echo "bootstrap: installing Debian packages: ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

stamp="$VENV/.bootstrap-stamp"
want="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [[ ! -x "$VENV/bin/python" ]]; then
    echo "bootstrap: creating $VENV"
    "$PYTHON" -m venv "$VENV"
fi
if [[ ! -f "$stamp" || "$(cat "$stamp")" != "$want" ]]; then
    echo "bootstrap: installing the pinned torch and the project into $VENV"
    "$VENV/bin/pip" install -q torch==2.13.0
    "$VENV/bin/pip" install -q -e '.[dev]'
    echo "$want" >"$stamp"
fi

if [[ "${TESTBED_SKIP_UML:-0}" != 1 ]]; then
    "$VENV/bin/testbed" sandbox prepare --quiet
fi
