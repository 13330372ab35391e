//! Builds the browser worker's wasm package (crate `cairn-web`) and embeds it, with the join
//! page, in the `cairn` binary, so `cairn serve` needs nothing from the source tree at run time.
//!
//! The package is built by a nested `cargo build -p cairn-web --target wasm32-unknown-unknown
//! --release` into `<target>/web-build` (its own target dir: the outer build holds the locks of
//! its own), then its JavaScript glue is generated with `wasm-bindgen-cli-support`, the library
//! the `wasm-bindgen` CLI is made of, so no tool has to be installed. `$OUT_DIR/web_assets.rs`
//! lists every file for `src/web_assets.rs` to `include_bytes!`.
//!
//! `CAIRN_SKIP_WEB=1` builds the binary without the assets (fast development builds); its
//! `/join` then says so.
//!
//! `CAIRN_WEB_THREADS=TOOLCHAIN` (a rustup toolchain name such as `nightly-2026-05-20`, or
//! `1` for `nightly`) builds a second package beside the first, `pkg/threads/`: the same
//! crate with shared memory (`+atomics`), so the CPU fallback runs on a team of Web Workers
//! where the page is cross-origin isolated (web/src/stage_worker.js chooses at run time). It
//! needs that toolchain with `rust-src`: the standard library is rebuilt with atomics
//! (`-Z build-std`), which only nightly offers. Unset, the binary carries the single-thread
//! package alone, built by the stable toolchain, and the fallback runs on one thread.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// The crate to build and the name its package files take.
const WEB_CRATE: &str = "cairn-web";
const PKG_NAME: &str = "cairn_web";
const WASM_TARGET: &str = "wasm32-unknown-unknown";
/// The threaded package's memory may grow to wasm32's whole 4 GiB (a shared memory must
/// declare its maximum; the linker's default is 1 GiB, too small for a CPU stage of a larger
/// model).
const THREADS_MAX_MEMORY: u64 = 4 << 30;

/// One package to build: the toolchain's flags and where it goes.
struct Flavor<'a> {
    /// `None`: the toolchain running this build (stable, as the workspace); else the rustup
    /// toolchain that builds with `-Z build-std`.
    toolchain: Option<&'a str>,
    /// `<target>/<this>`: the nested build's own target dir.
    target_subdir: &'a str,
    rustflags: String,
}

fn main() {
    let manifest_dir = PathBuf::from(env("CARGO_MANIFEST_DIR"));
    let root = manifest_dir
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| fail("the cairn package has no parent directory (the workspace)"));
    let out_dir = PathBuf::from(env("OUT_DIR"));

    println!("cargo:rerun-if-env-changed=CAIRN_SKIP_WEB");
    println!("cargo:rerun-if-env-changed=CAIRN_WEB_THREADS");
    // Everything the package is made of; the join page itself is tracked by `include_bytes!`.
    for input in [
        "web/src",
        "web/Cargo.toml",
        "web/www/join.html",
        "engine/src",
        "engine/Cargo.toml",
        "shaders",
        "Cargo.toml",
        "Cargo.lock",
    ] {
        println!("cargo:rerun-if-changed={}", root.join(input).display());
    }

    let skip = std::env::var_os("CAIRN_SKIP_WEB").is_some_and(|v| !v.is_empty() && v != "0");
    let files = if skip {
        println!(
            "cargo:warning=CAIRN_SKIP_WEB is set: this cairn carries no join page or wasm package"
        );
        Vec::new()
    } else {
        let pkg = out_dir.join("pkg");
        // WebAssembly SIMD for the CPU fallback's kernels (engine/src/backend/cpu/dot/
        // simd128.rs): wasm cannot detect it at run time, so the package is built with it;
        // every current browser runs it (Chrome 91, Firefox 89, Safari 16.4).
        let single = Flavor {
            toolchain: None,
            target_subdir: "web-build",
            rustflags: "-Ctarget-feature=+simd128".into(),
        };
        build_package(&root, &out_dir, &pkg, &single);
        if let Some(toolchain) = threads_toolchain() {
            // Shared memory needs atomics and bulk memory (wasm-bindgen's thread support) and
            // mutable globals (each thread's stack pointer); every browser with
            // SharedArrayBuffer has all three. The linker is told to make the memory shared
            // and imported (each worker instantiates the module over the first one's) and to
            // export what wasm-bindgen sets each thread's thread-locals up with.
            // It is built with relaxed SIMD as well (the CPU fallback's integer dot products:
            // engine/src/backend/cpu/dot/simd128.rs): Chromium has it since 114 and Firefox
            // since 146, Safari not (2026); where it is missing, the page runs the
            // single-thread package (web/src/stage_worker.js checks before loading this one).
            let mut rustflags = String::from(
                "-Ctarget-feature=+simd128,+relaxed-simd,+atomics,+bulk-memory,+mutable-globals",
            );
            for arg in [
                "--shared-memory".to_owned(),
                "--import-memory".to_owned(),
                format!("--max-memory={THREADS_MAX_MEMORY}"),
                "--export=__wasm_init_tls".to_owned(),
                "--export=__tls_size".to_owned(),
                "--export=__tls_align".to_owned(),
                "--export=__tls_base".to_owned(),
            ] {
                let _ = write!(rustflags, "\x1f-Clink-arg={arg}");
            }
            let threaded = Flavor {
                toolchain: Some(&toolchain),
                target_subdir: "web-build-threads",
                rustflags,
            };
            build_package(&root, &out_dir, &pkg.join("threads"), &threaded);
        }
        let mut files = vec![("www/join.html".to_owned(), root.join("web/www/join.html"))];
        collect(&pkg, &pkg, &mut files);
        files
    };
    write_manifest(&out_dir.join("web_assets.rs"), &files);
}

/// The toolchain `CAIRN_WEB_THREADS` names for the threaded package, if any.
fn threads_toolchain() -> Option<String> {
    let v = std::env::var("CAIRN_WEB_THREADS").ok()?;
    match v.trim() {
        "" | "0" => None,
        "1" => Some("nightly".into()),
        name => Some(name.to_owned()),
    }
}

/// Fails with the command that fixes it when `toolchain` cannot rebuild the standard library
/// for wasm32 (it needs `rust-src`).
fn check_build_std(toolchain: &str) {
    let sysroot = Command::new("rustup")
        .args(["run", toolchain, "rustc", "--print", "sysroot"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| PathBuf::from(String::from_utf8_lossy(&o.stdout).trim()));
    let has_src = sysroot
        .as_ref()
        .is_some_and(|s| s.join("lib/rustlib/src/rust/library/std").is_dir());
    if !has_src {
        fail(&format!(
            "CAIRN_WEB_THREADS={toolchain} asks for the threaded wasm package, which rebuilds \
             the standard library with atomics; that needs the {toolchain} toolchain with its \
             sources. Install them with:\n\n    rustup toolchain install {toolchain} --profile \
             minimal -c rust-src\n\n(or unset CAIRN_WEB_THREADS: the CPU fallback then runs on \
             one thread)"
        ));
    }
}

fn build_package(root: &Path, out_dir: &Path, pkg: &Path, flavor: &Flavor<'_>) {
    let target_dir = nested_target_dir(out_dir, flavor.target_subdir);
    let mut cmd = match flavor.toolchain {
        None => {
            check_wasm_target();
            Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()))
        }
        Some(toolchain) => {
            check_build_std(toolchain);
            let mut cmd = Command::new("rustup");
            cmd.args(["run", toolchain, "cargo"]);
            cmd
        }
    };
    cmd.current_dir(root).args([
        "build",
        "-p",
        WEB_CRATE,
        "--release",
        "--target",
        WASM_TARGET,
    ]);
    if flavor.toolchain.is_some() {
        cmd.args(["-Z", "build-std=panic_abort,std"]);
        // The outer build's compiler is the stable one.
        for key in ["RUSTC", "RUSTDOC", "RUSTUP_TOOLCHAIN", "CARGO"] {
            cmd.env_remove(key);
        }
    }
    cmd.arg("--manifest-path")
        .arg(root.join("Cargo.toml"))
        .arg("--target-dir")
        .arg(&target_dir);
    // The outer build's flags and settings are for the host and for this package: the nested
    // build must not take them (RUSTFLAGS such as `-C target-cpu=native` break wasm32, and
    // clippy's wrapper would lint the web crate on every `cargo clippy`). The jobserver
    // (CARGO_MAKEFLAGS) and CARGO_BUILD_JOBS are kept, so `-j` bounds both builds together.
    for (key, _) in std::env::vars_os() {
        let Some(key) = key.to_str() else { continue };
        let outer = key.starts_with("CARGO_PKG_")
            || key.starts_with("CARGO_CFG_")
            || key.starts_with("CARGO_FEATURE_")
            || key.starts_with("CARGO_MANIFEST_")
            || key.starts_with("DEP_");
        if outer {
            cmd.env_remove(key);
        }
    }
    for key in [
        "CARGO_ENCODED_RUSTFLAGS",
        "CARGO_ENCODED_RUSTDOCFLAGS",
        "RUSTFLAGS",
        "RUSTDOCFLAGS",
        "CARGO_BUILD_RUSTFLAGS",
        "CARGO_TARGET_DIR",
        "CARGO_BUILD_TARGET",
        "CARGO_BUILD_TARGET_DIR",
        "CARGO_BUILD_BUILD_DIR",
        "CARGO_PRIMARY_PACKAGE",
        "RUSTC_WORKSPACE_WRAPPER",
        "RUSTC_LINKER",
        "TARGET",
        "HOST",
        "OUT_DIR",
        "PROFILE",
        "OPT_LEVEL",
        "DEBUG",
        "NUM_JOBS",
    ] {
        cmd.env_remove(key);
    }
    cmd.env("CARGO_ENCODED_RUSTFLAGS", &flavor.rustflags);
    // Cargo reads this script's stdout for directives; the nested build's output is for people.
    cmd.stdout(Stdio::from(std::io::stderr()));
    let status = cmd
        .status()
        .unwrap_or_else(|e| fail(&format!("cannot start cargo for the wasm package: {e}")));
    if !status.success() {
        fail(&format!(
            "building the browser worker's wasm package (cargo {}build -p {WEB_CRATE} --target \
             {WASM_TARGET} --release, target dir {}) failed; its errors are above",
            flavor
                .toolchain
                .map(|t| format!("+{t} "))
                .unwrap_or_default(),
            target_dir.display()
        ));
    }

    let wasm = target_dir
        .join(WASM_TARGET)
        .join("release")
        .join(format!("{PKG_NAME}.wasm"));
    // Settings of `wasm-bindgen --target web --out-name cairn_web --no-typescript`.
    let tmp = out_dir.join("pkg.tmp");
    let _ = std::fs::remove_dir_all(&tmp);
    let mut bindgen = wasm_bindgen_cli_support::Bindgen::new();
    bindgen
        .input_path(&wasm)
        .out_name(PKG_NAME)
        .typescript(false)
        // The library's default differs from the CLI's: without it `init()` needs the URL.
        .omit_default_module_path(false);
    let generated = bindgen
        .web(true)
        .and_then(|b| b.generate(&tmp))
        .map_err(|e| format!("{e:#}"));
    if let Err(e) = generated {
        fail(&format!(
            "wasm-bindgen could not make the package from {}: {e}",
            wasm.display()
        ));
    }
    let _ = std::fs::remove_dir_all(pkg);
    if let Err(e) = std::fs::rename(&tmp, pkg) {
        fail(&format!(
            "cannot move the package to {}: {e}",
            pkg.display()
        ));
    }
}

/// Fails with the command that fixes it when the standard library for wasm32 is missing
/// (it comes with the target: rustup installs it).
fn check_wasm_target() {
    let rustc = std::env::var_os("RUSTC").unwrap_or_else(|| "rustc".into());
    let libdir = Command::new(rustc)
        .args(["--print", "target-libdir", "--target", WASM_TARGET])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| PathBuf::from(String::from_utf8_lossy(&o.stdout).trim()));
    let has_std = libdir
        .and_then(|d| std::fs::read_dir(d).ok())
        .is_some_and(|mut entries| {
            entries.any(|e| {
                e.ok()
                    .and_then(|e| e.file_name().into_string().ok())
                    .is_some_and(|n| n.starts_with("libstd-") && n.ends_with(".rlib"))
            })
        });
    if !has_std {
        fail(&format!(
            "the {WASM_TARGET} target is not installed, and the cairn binary carries the browser \
             worker built for it. Install it with:\n\n    rustup target add {WASM_TARGET}\n\n\
             (or set CAIRN_SKIP_WEB=1 to build a cairn without the join page)"
        ));
    }
}

/// `<target>/<subdir>`: the outer target dir is the nearest ancestor of OUT_DIR that cargo
/// tagged with CACHEDIR.TAG; OUT_DIR itself if none is (the nested build is then not shared
/// between feature sets, only slower).
fn nested_target_dir(out_dir: &Path, subdir: &str) -> PathBuf {
    out_dir
        .ancestors()
        .skip(1)
        .find(|dir| dir.join("CACHEDIR.TAG").is_file())
        .map(|dir| dir.join(subdir))
        .unwrap_or_else(|| out_dir.join(subdir))
}

/// Every file under `dir`, keyed `pkg/<path relative to base>` with `/` separators.
fn collect(base: &Path, dir: &Path, files: &mut Vec<(String, PathBuf)>) {
    let entries = std::fs::read_dir(dir)
        .unwrap_or_else(|e| fail(&format!("cannot read {}: {e}", dir.display())));
    let mut paths: Vec<PathBuf> = entries.filter_map(|e| e.ok().map(|e| e.path())).collect();
    paths.sort();
    for path in paths {
        if path.is_dir() {
            collect(base, &path, files);
        } else if let Ok(rel) = path.strip_prefix(base) {
            let parts: Vec<String> = rel
                .components()
                .map(|c| c.as_os_str().to_string_lossy().into_owned())
                .collect();
            files.push((format!("pkg/{}", parts.join("/")), path));
        }
    }
}

fn write_manifest(path: &Path, files: &[(String, PathBuf)]) {
    let mut src = String::from("&[\n");
    for (name, file) in files {
        let file = file
            .to_str()
            .unwrap_or_else(|| fail(&format!("{} is not UTF-8", file.display())));
        let _ = writeln!(src, "    ({name:?}, include_bytes!({file:?}).as_slice()),");
    }
    src.push_str("]\n");
    if let Err(e) = std::fs::write(path, src) {
        fail(&format!("cannot write {}: {e}", path.display()));
    }
}

fn env(key: &str) -> String {
    std::env::var(key).unwrap_or_else(|_| fail(&format!("cargo did not set {key}")))
}

/// Ends the build with `message`, which cargo shows under the failed build script.
fn fail(message: &str) -> ! {
    eprintln!("\nerror: {message}\n");
    std::process::exit(1)
}
