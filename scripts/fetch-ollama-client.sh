#!/usr/bin/env bash
# Installs Ollama's official Python client (with httpx and pydantic) into a private folder,
# $XDG_CACHE_HOME/cairn/ollama-client-<version> (default ~/.cache/cairn/...), for the cluster
# test that drives `cairn serve`'s Ollama routes with it. The test puts the folder on
# PYTHONPATH, so nothing lands in the system's Python.
set -euo pipefail
version=0.6.3
dest="${XDG_CACHE_HOME:-$HOME/.cache}/cairn/ollama-client-$version"
if PYTHONPATH="$dest" python3 -c "import ollama" 2>/dev/null; then
    exit 0
fi
"$(dirname "$0")/ensure-pip.sh" "Ollama's Python client"
tmp="$dest.tmp"
rm -rf "$tmp"
python3 -m pip install --quiet --disable-pip-version-check --no-warn-script-location \
    --target "$tmp" "ollama==$version"
rm -rf "$dest"
mv "$tmp" "$dest"
echo "Ollama's Python client $version is in $dest"
