#!/usr/bin/env bash
# Install the Debian packages the cluster-engine tests run for real: SLURM (slurm-wlm,
# munge) and Open MPI (openmpi-bin). Only missing packages are installed; with all
# present this returns at once. Needs root and apt-get; elsewhere it says why and does
# nothing (those tests then skip, naming what is missing).
#   bash scripts/cluster_packages.sh
set -euo pipefail
PACKAGES=(slurm-wlm munge openmpi-bin)
say() { printf 'cluster_packages: %s\n' "$*"; }

missing=()
for pkg in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'install ok installed'; then
    missing+=("$pkg")
  fi
done
if [ ${#missing[@]} -eq 0 ]; then
  say "already installed: ${PACKAGES[*]}"
  exit 0
fi
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null; then
  say "cannot install ${missing[*]} (needs root and apt-get); their tests will skip" >&2
  exit 0
fi
say "installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
log=$(mktemp)
if ! { apt-get update -q && apt-get install -y -q --no-install-recommends "${missing[@]}"; } >"$log" 2>&1; then
  cat "$log" >&2
  rm -f "$log"
  say "apt-get failed (its output is above)" >&2
  exit 1
fi
rm -f "$log"
say "installed ${missing[*]}"
