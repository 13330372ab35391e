#!/usr/bin/env bash
# The cpu backend's aarch64 NEON kernels against the scalar reference, on an x86-64 machine:
# the engine's unit tests cross-compiled for aarch64-unknown-linux-gnu and run under qemu's
# user-mode emulation (Debian: qemu-user-static, gcc-aarch64-linux-gnu as the linker,
# libc6-dev-arm64-cross for the C runtime; scripts/test.sh installs them).
#
# Only the cpu backend's tests run (`backend::cpu::`): every format's SIMD-vs-scalar
# comparison, the four-token and tiled paths, attention's f32 helpers and the run-time kernel
# check. Twice: on qemu's default CPU (`max`: NEON and the dot-product extension, so both
# `neon` and `neon+dotprod` are compared) and as a Cortex-A53 (NEON without it: the
# detection must fall back to `neon`).
#
#   scripts/test-aarch64.sh [extra cargo test args]
set -euo pipefail
cd "$(dirname "$0")/.."

target=aarch64-unknown-linux-gnu
sysroot=/usr/aarch64-linux-gnu
for tool in aarch64-linux-gnu-gcc qemu-aarch64-static; do
    if ! command -v "$tool" >/dev/null; then
        echo "$tool is missing: apt-get install qemu-user-static gcc-aarch64-linux-gnu libc6-dev-arm64-cross" >&2
        exit 1
    fi
done
rustup target add "$target" >/dev/null

export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER="qemu-aarch64-static -L $sysroot"

echo "== aarch64 (qemu, cpu max: neon + dotprod): cargo test -p cairn-engine --lib backend::cpu::"
cargo test -p cairn-engine --lib --target "$target" "$@" -- backend::cpu::
echo "== aarch64 (qemu, Cortex-A53: neon without dotprod)"
QEMU_CPU=cortex-a53 cargo test -p cairn-engine --lib --target "$target" "$@" -- backend::cpu::
