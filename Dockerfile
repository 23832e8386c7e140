# One image for every fleetmend process: `fleetmend worker`, `fleetmend webhook`,
# `fleetmend sim`, and the one-shot jobs (ledger migrations, search attributes).
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY fleet fleet
COPY workflows workflows
COPY kube kube
COPY activities activities
COPY gateway gateway
COPY ledger ledger
COPY worker worker
COPY sim sim
RUN pip install --no-cache-dir --prefix=/install .

FROM python:3.11-slim
# The Worker Deployment build id (README, "Roll a new worker during an incident"): pass the image's
# own tag or commit, e.g. --build-arg BUILD_ID=$(git rev-parse --short HEAD); empty = package version.
ARG BUILD_ID=""
RUN useradd --create-home --uid 10001 fleetmend \
 && mkdir -p /var/lib/fleetmend/sim \
 && chown -R fleetmend:fleetmend /var/lib/fleetmend
COPY --from=build /install /usr/local
COPY deploy /opt/fleetmend/deploy
COPY sim/scenarios /opt/fleetmend/scenarios
ENV PYTHONUNBUFFERED=1 \
    FLEETMEND_STATE_DIR=/var/lib/fleetmend \
    FLEETMEND_WORKER_BUILD_ID=${BUILD_ID}
USER fleetmend
WORKDIR /var/lib/fleetmend
ENTRYPOINT ["fleetmend"]
CMD ["worker"]
