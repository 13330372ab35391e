#!/usr/bin/env bash
# Fetches llama.cpp's tokenizer test data: vocabulary-only GGUF files with inputs and the ids
# llama.cpp produces for them (models/ggml-vocab-*.gguf, .gguf.inp, .gguf.out), and its
# collection of real chat templates (models/templates/*.jinja). Both come with the source package
# of llama-cpp-python 0.3.36 (llama.cpp under vendor/llama.cpp, MIT licence). They land in
# $XDG_CACHE_HOME/cairn/llama-cpp-python-0.3.36 (default ~/.cache/cairn/...), where the tokenizer
# tests look (or set CAIRN_VOCAB_DIR). Does nothing when they are already there.
set -euo pipefail

version=0.3.36
sha256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
dest="${XDG_CACHE_HOME:-$HOME/.cache}/cairn/llama-cpp-python-$version"

if [ -f "$dest/.complete" ]; then
    echo "vocab files present: $dest"
    exit 0
fi

"$(dirname "$0")/ensure-pip.sh" "the source package"

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# pip reads an sdist's metadata through its build backend even to download it, and that backend
# (scikit-build-core) looks for CMake while doing so. Without build isolation both need only be
# importable (with isolation pip would compile CMake from source first); an install into a
# private --target folder works on a Debian whose Python is externally managed, and is thrown
# away with the download.
python3 -m pip install --quiet --no-warn-script-location --target "$tmp/backend" \
    scikit-build-core cmake
PATH="$tmp/backend/bin:$PATH" PYTHONPATH="$tmp/backend" python3 -m pip download --quiet \
    --no-deps --no-binary :all: --no-build-isolation "llama-cpp-python==$version" -d "$tmp/dl"
archive="$tmp/dl/llama_cpp_python-$version.tar.gz"
got=$(sha256sum "$archive" | cut -d' ' -f1)
if [ "$got" != "$sha256" ]; then
    echo "llama-cpp-python $version source package has sha256 $got, expected $sha256" >&2
    exit 1
fi

rm -rf "$dest.part"
mkdir -p "$dest.part"
prefix="llama_cpp_python-$version/vendor/llama.cpp/models"
tar -xzf "$archive" -C "$dest.part" --strip-components=4 --wildcards \
    "$prefix/ggml-vocab-*" "$prefix/templates/*.jinja"
touch "$dest.part/.complete"
rm -rf "$dest"
mv "$dest.part" "$dest"
echo "vocab files fetched: $dest ($(ls "$dest" | grep -c '\.gguf$') vocabularies)"
