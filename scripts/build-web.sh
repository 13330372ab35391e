#!/usr/bin/env bash
# Copies the browser worker's wasm package into web/pkg/, for serving web/ yourself: the
# package example (web/www/example.html), or `CAIRN_WEB_DIR=web cairn serve` to work on
# web/www/join.html without rebuilding the binary. `cairn serve` itself needs none of this:
# building cairn builds the package (native/build.rs) and embeds it.
#   scripts/build-web.sh [extra cargo build flags...]
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
# The package is made by cairn's build script; its output directory holds it under pkg/.
out_dir="$(cargo build -p cairn --message-format=json-render-diagnostics "$@" |
  grep '"reason":"build-script-executed"' | grep -F '/native#cairn@' |
  sed -n 's/.*"out_dir":"\([^"]*\)".*/\1/p' | tail -n 1)"
if [[ -z "$out_dir" || ! -f "$out_dir/pkg/cairn_web_bg.wasm" ]]; then
  echo "cairn's build made no package (is CAIRN_SKIP_WEB set?)" >&2
  exit 1
fi
rm -rf web/pkg
cp -r "$out_dir/pkg" web/pkg
echo "copied $(du -h web/pkg/cairn_web_bg.wasm | cut -f1) of wasm into web/pkg"
