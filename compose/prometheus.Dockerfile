# Prometheus from Debian's package, for machines that cannot pull prom/prometheus: set
# PROMETHEUS_IMAGE to this image's tag (scripts/compose-images.sh builds it as
# testbed-prometheus:latest).
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}
ENV DEBIAN_FRONTEND=noninteractive
COPY compose/ca/ /usr/local/share/ca-certificates/
RUN if command -v update-ca-certificates >/dev/null; then update-ca-certificates >/dev/null; fi \
    && apt-get update && apt-get install -y --no-install-recommends prometheus \
    && rm -rf /var/lib/apt/lists/* && mkdir -p /prometheus
