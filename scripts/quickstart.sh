#!/usr/bin/env bash
# The main job on a fresh machine: fetch the default model if missing, build, run a prompt.
# Usage: scripts/quickstart.sh ["your prompt"] [extra cairn run flags...]
set -euo pipefail
cd "$(dirname "$0")/.."
prompt="${1:-Write a haiku about stacking stones.}"
shift || true
scripts/fetch-model.sh
cargo build --release -p cairn
exec target/release/cairn run --prompt "$prompt" "$@"
