#!/usr/bin/env bash
# Builds the browser worker (crate cairn-web) for wasm32 and runs wasm-bindgen into web/pkg/,
# which the coordinator serves at /pkg/ beside web/www/join.html at /join.
# Skips the work when web/pkg/ is newer than every source it is made from.
#   scripts/build-web.sh [--force]
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
out="$root/web/pkg"
target_dir="${CARGO_TARGET_DIR:-$root/target}"
wasm="$target_dir/wasm32-unknown-unknown/release/cairn_web.wasm"

if [[ "${1:-}" != "--force" && -f "$out/cairn_web_bg.wasm" ]]; then
  newer="$(find web/src web/Cargo.toml engine/src engine/Cargo.toml shaders Cargo.lock \
    -newer "$out/cairn_web_bg.wasm" -print -quit 2>/dev/null || true)"
  if [[ -z "$newer" ]]; then
    echo "web/pkg is up to date"
    exit 0
  fi
fi

want="$(awk '/^name = "wasm-bindgen"$/ { getline; gsub(/[^0-9.]/, ""); print; exit }' Cargo.lock)"
have="$(wasm-bindgen --version 2>/dev/null | awk '{ print $2 }')"
if [[ "$have" != "$want" ]]; then
  echo "wasm-bindgen CLI $want is needed (found '${have:-none}'):" >&2
  echo "  cargo install wasm-bindgen-cli --version $want" >&2
  exit 1
fi
if ! rustup target list --installed 2>/dev/null | grep -qx wasm32-unknown-unknown; then
  echo "the wasm32 target is missing: rustup target add wasm32-unknown-unknown" >&2
  exit 1
fi

cargo build -p cairn-web --target wasm32-unknown-unknown --release ${CARGO_BUILD_JOBS:+-j "$CARGO_BUILD_JOBS"}
rm -rf "$out.tmp"
wasm-bindgen --target web --out-dir "$out.tmp" --out-name cairn_web "$wasm"
rm -rf "$out"
mv "$out.tmp" "$out"
echo "built $(du -h "$out/cairn_web_bg.wasm" | cut -f1) into web/pkg"
