#!/usr/bin/env bash
# Installs the Debian packages the end-to-end tests use, when they are missing
# and apt-get is available. Never fails the build: tests that need a missing
# tool skip with a loud reason instead.
set -u
need=()
command -v prometheus >/dev/null 2>&1 || need+=(prometheus)
command -v prometheus-alertmanager >/dev/null 2>&1 || command -v alertmanager >/dev/null 2>&1 || need+=(prometheus-alertmanager)
command -v chromium >/dev/null 2>&1 || need+=(chromium)
if [ ${#need[@]} -eq 0 ]; then exit 0; fi
if ! command -v apt-get >/dev/null 2>&1 || [ "$(id -u)" != 0 ]; then
  echo "system-deps: cannot install ${need[*]} (no apt-get or not root); tests needing them will skip" >&2
  exit 0
fi
echo "system-deps: installing ${need[*]} from Debian packages" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >/dev/null 2>&1 || true
apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null 2>&1 \
  || echo "system-deps: apt-get install ${need[*]} failed; tests needing them will skip" >&2
# The Debian packages start services on install; fleetmend's tests start their own.
for svc in prometheus prometheus-alertmanager prometheus-node-exporter; do
  (command -v systemctl >/dev/null && systemctl stop "$svc") >/dev/null 2>&1 || true
  pkill -x "$svc" >/dev/null 2>&1 || true
done
exit 0
