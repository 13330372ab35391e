#!/usr/bin/env bash
# The whole test suite, from a fresh Debian/Ubuntu machine with only Rust present: installs what
# the tests need (lavapipe for wgpu on the CPU, Chromium, the wasm32 target), fetches the default
# model, then runs formatting, lints and every test. Building cairn builds the browser worker
# (the engine for wasm32, once single-threaded with the stable toolchain and once threaded with
# a pinned nightly) into the binary (native/build.rs), so clippy already covers that build.
set -euo pipefail
cd "$(dirname "$0")/.."

sudo_cmd=""
[ "$(id -u)" -eq 0 ] || sudo_cmd="sudo"
need=()
dpkg -s mesa-vulkan-drivers >/dev/null 2>&1 || need+=(mesa-vulkan-drivers libvulkan1)
dpkg -s chromium >/dev/null 2>&1 || need+=(chromium chromium-driver)
python3 -m pip --version >/dev/null 2>&1 || need+=(python3-pip)
# The chaos test (tests/tests/chaos.rs) makes its namespaces' veth pairs with `ip`.
command -v ip >/dev/null 2>&1 || need+=(iproute2)
# The cpu backend's aarch64 NEON kernels run under qemu (scripts/test-aarch64.sh).
dpkg -s qemu-user-static >/dev/null 2>&1 || need+=(qemu-user-static)
dpkg -s gcc-aarch64-linux-gnu >/dev/null 2>&1 || need+=(gcc-aarch64-linux-gnu)
dpkg -s libc6-dev-arm64-cross >/dev/null 2>&1 || need+=(libc6-dev-arm64-cross)
if [ ${#need[@]} -gt 0 ]; then
    echo "== apt-get install ${need[*]}"
    $sudo_cmd apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq "${need[@]}" >/dev/null
fi

echo "== rust components and targets"
rustup component add rustfmt clippy >/dev/null 2>&1 || true
rustup target add wasm32-unknown-unknown >/dev/null
rustup target add aarch64-unknown-linux-gnu >/dev/null
# The CPU fallback's threaded wasm package (native/build.rs, CAIRN_WEB_THREADS): shared
# memory needs the standard library rebuilt with atomics (-Z build-std), which only nightly
# offers; pinned, with its sources. About 50 s to install, plus about 2 min of build on 2
# cores for the second package (docs/performance.md, session 17).
threads_toolchain=nightly-2026-05-20
rustup toolchain install "$threads_toolchain" --profile minimal -c rust-src >/dev/null
export CAIRN_WEB_THREADS="$threads_toolchain"

scripts/fetch-model.sh
# llama.cpp's tokenizer test data (vocabulary files with expected ids), for engine/tests/vocab.rs.
scripts/fetch-vocab.sh
# Ollama's official Python client, for the cluster test of the Ollama routes.
scripts/fetch-ollama-client.sh

# Mesa warns without a private runtime directory.
export XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-$(mktemp -d)}"
chmod 700 "$XDG_RUNTIME_DIR" 2>/dev/null || true
export CARGO_BUILD_JOBS="${CARGO_BUILD_JOBS:-2}"
# A clean run gains nothing from incremental state, which is several GiB on disk.
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"

# The vendor fast paths are compiled and tested too: `vulkan` runs on lavapipe here; `cuda`
# builds without a toolkit (libcuda and libnvrtc are opened at run time), and on a machine
# without an NVIDIA driver its tests print why they skip the cuda devices. One feature set for
# clippy, the build and the tests, so nothing is compiled twice. `cairn/dev-hooks` compiles
# the development hooks in (release builds leave them off): the cluster test that loses a
# pass between workers needs its fault injector in the cairn binary.
features="cairn-engine/vulkan cairn-engine/cuda cairn/dev-hooks"

echo "== cargo fmt --check"
cargo fmt --all -- --check
echo "== cargo clippy"
cargo clippy --workspace --all-targets --features "$features" -- -D warnings
# The engine as the browser runs it (wasm32: the simd128 and relaxed-SIMD kernels, the
# browser's wgpu), as native/build.rs builds its packages.
CARGO_TARGET_WASM32_UNKNOWN_UNKNOWN_RUSTFLAGS="-Ctarget-feature=+simd128,+relaxed-simd" \
    cargo clippy -p cairn-engine -p cairn-web --target wasm32-unknown-unknown -- -D warnings
echo "== tests"
df -h . | tail -1
# The end-to-end tests start the cairn and cairn-signal binaries of this build as real
# processes, and the browser tests must not skip for want of Chromium.
export CAIRN_TEST_REQUIRE_BROWSER=1
# Nor may the tokenizer tests skip for want of llama.cpp's vocabulary files.
export CAIRN_TEST_REQUIRE_VOCAB=1
# Nor may the Ollama route test skip for want of the Python client.
export CAIRN_TEST_REQUIRE_OLLAMA_CLIENT=1
# Kernel and model tests must also run on a wgpu adapter (lavapipe here), not only the CPU.
cargo build -p cairn -p cairn-signal --features "$features"
CAIRN_TEST_REQUIRE_GPU=1 cargo test --workspace --features "$features"
# The aarch64 NEON kernels against the scalar reference: the engine's cpu-backend unit tests,
# cross-compiled and run under qemu (with and without the dot-product extension).
scripts/test-aarch64.sh
