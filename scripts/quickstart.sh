#!/usr/bin/env bash
# The main job on a fresh machine: fetch the default model if missing, build, run a prompt.
# Usage: scripts/quickstart.sh ["your prompt"] [extra cairn run flags...]
set -euo pipefail
cd "$(dirname "$0")/.."
prompt="${1:-Write a haiku about stacking stones.}"
shift || true
scripts/fetch-model.sh
# The binary carries the browser worker, built for wasm32 as part of building cairn.
if command -v rustup >/dev/null; then rustup target add wasm32-unknown-unknown; fi
cargo build --release -p cairn
# Mesa (the GPU drivers wgpu probes) complains on stderr without a private runtime directory,
# which containers and root shells often lack.
if [ -z "${XDG_RUNTIME_DIR:-}" ] || [ ! -w "${XDG_RUNTIME_DIR}" ]; then
    XDG_RUNTIME_DIR="$(mktemp -d)"
    chmod 700 "$XDG_RUNTIME_DIR"
    export XDG_RUNTIME_DIR
fi
exec target/release/cairn run --prompt "$prompt" "$@"
