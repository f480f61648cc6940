#!/usr/bin/env bash
# Installs the Debian packages psd needs to build and test, if missing.
# Runs apt-get as root, or through sudo.
set -euo pipefail
pkgs=(build-essential cmake pkg-config libevent-dev libprotobuf-c-dev
      protobuf-c-compiler libopenblas-dev check libslurm-dev libpmi2-0-dev libmunge-dev munge
      libsodium-dev gnuplot-nox jq iproute2 openmpi-bin libopenmpi-dev
      python3-numpy python3-pytest python3-torch python3-venv python3-pip)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "deps: installing ${missing[*]}"
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO=sudo
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
