#!/usr/bin/env bash
# Installs everything the testbed needs on an apt-based Linux machine (Debian, Ubuntu, ...) with
# Python 3.11 or newer, idempotently: the distribution's packages, a venv with the pinned CPU
# torch and the project with every extra, and the cached UML kernel (its packages come from
# Debian; on another distribution set TESTBED_APT_MIRROR to a Debian mirror, docs/sandbox.md).
set -euo pipefail
cd "$(dirname "$0")/.."

APT_PACKAGES=(iproute2 nftables kmod iputils-ping ethtool patchelf ca-certificates prometheus iperf3)
VENV=${TESTBED_VENV:-.venv}
TORCH=${TESTBED_TORCH:-torch==2.13.0}  # the CPU build the results were measured with

if ! command -v apt-get >/dev/null; then
    echo "bootstrap: needs apt-get (Debian, Ubuntu); elsewhere install by hand: ${APT_PACKAGES[*]}," \
         "Python >= 3.11, then pip install -e '.[dev]' (README, 'Other systems')" >&2
    exit 2
fi
PYTHON=${PYTHON:-}
if [[ -z "$PYTHON" ]]; then
    # 3.11 first: the version the results were measured with (and the local torch wheel's).
    for candidate in python3.11 python3 python3.12 python3.13; do
        if command -v "$candidate" >/dev/null \
            && "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
            PYTHON=$candidate
            break
        fi
    done
fi
if [[ -z "$PYTHON" ]]; then
    echo "bootstrap: needs Python >= 3.11 (with venv); none found on PATH (set PYTHON=...)" >&2
    exit 2
fi

missing=()
for pkg in "${APT_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if ((${#missing[@]})); then
    echo "bootstrap: installing the distribution's packages: ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

stamp="$VENV/.bootstrap-stamp"
want="$(cat pyproject.toml scripts/bootstrap.sh | sha256sum | cut -d' ' -f1)"
if [[ ! -x "$VENV/bin/python" ]]; then
    echo "bootstrap: creating $VENV with $PYTHON"
    "$PYTHON" -m venv "$VENV"
fi
if [[ ! -f "$stamp" || "$(cat "$stamp")" != "$want" ]]; then
    echo "bootstrap: installing $TORCH and the project into $VENV"
    "$VENV/bin/pip" install -q "$TORCH"
    "$VENV/bin/pip" install -q -e '.[dev]'
    echo "$want" >"$stamp"
fi

if [[ "${TESTBED_SKIP_UML:-0}" != 1 ]]; then
    "$VENV/bin/testbed" sandbox prepare --quiet
fi
