//! cmake over the patched tree (shim/CMakeLists.txt: Release, CPU, static,
//! offline), building into TARGET/llama/build.

use std::env;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::pin::Pin;

/// Configures the wrapper project (shim/CMakeLists.txt) over the patched
/// tree and builds `target` of it; returns the cmake build directory.
pub fn build(root: &Path, src: &Path, pin: &Pin, work: &Path, target: &str) -> PathBuf {
    let native = env::var("SDQ_GGML_NATIVE").map(|v| v != "0" && v != "OFF").unwrap_or(true);
    let amx = env::var("SDQ_GGML_AMX").is_ok_and(|v| v == "1" || v == "ON");
    let mut cfg = cmake::Config::new(root.join("shim"));
    // No flags derived from the Cargo profile (debug info, opt-level): CMake's
    // Release flags plus CFLAGS/CXXFLAGS from the environment (the sanitizer
    // script's), the same for every profile and target directory.
    cfg.out_dir(work).no_default_flags(true).define("CMAKE_POSITION_INDEPENDENT_CODE", "ON");
    // Always Release: ggml checks get_alloc_size >= nbytes with a plain assert,
    // and sdq's 4 KiB expert buffers rely on NDEBUG compiling it out.
    cfg.profile("Release")
        .define("SDQ_LLAMA_SRC", src)
        .define("BUILD_SHARED_LIBS", "OFF")
        .define("GGML_BACKEND_DL", "OFF")
        .define("GGML_NATIVE", if native { "ON" } else { "OFF" })
        .define("SDQ_GGML_AMX", if amx { "ON" } else { "OFF" })
        .define("GGML_OPENMP", "OFF")
        .define("GGML_CPU", "ON")
        // ggml's RPC backend: --rpc in every tool, and rpc-server.
        .define("GGML_RPC", "ON")
        .define("LLAMA_BUILD_COMMON", "ON")
        .define("LLAMA_BUILD_TOOLS", "ON")
        .define("LLAMA_BUILD_SERVER", "ON")
        .define("LLAMA_BUILD_TESTS", "OFF")
        .define("LLAMA_BUILD_EXAMPLES", "OFF")
        .define("LLAMA_BUILD_APP", "OFF")
        .define("LLAMA_BUILD_UI", "OFF")
        .define("LLAMA_USE_PREBUILT_UI", "OFF")
        .define("LLAMA_OPENSSL", "OFF")
        .define("LLAMA_LLGUIDANCE", "OFF")
        .define("LLAMA_ALL_WARNINGS", "OFF")
        .define("LLAMA_BUILD_NUMBER", "1")
        .define("LLAMA_BUILD_COMMIT", &pin.commit[..7])
        .build_target(target);
    let ninja = Command::new("ninja").arg("--version").output().is_ok_and(|o| o.status.success());
    if ninja {
        cfg.generator("Ninja");
    }
    forget_stale_generator(&work.join("build"), ninja);
    if let Ok(jobs) = env::var("SDQ_CMAKE_JOBS") {
        cfg.build_arg(format!("-j{jobs}"));
    }
    cfg.build().join("build")
}

/// A build directory configured with another generator, or with a make
/// program that is gone (ninja uninstalled since), makes cmake stop at once;
/// its cache is dropped so the configure step starts over (objects stay).
fn forget_stale_generator(build_dir: &Path, ninja: bool) {
    let cache = build_dir.join("CMakeCache.txt");
    let Ok(text) = fs::read_to_string(&cache) else { return };
    let value = |key: &str| text.lines().find_map(|l| l.strip_prefix(key)).map(str::to_string);
    let was_ninja = value("CMAKE_GENERATOR:INTERNAL=").is_some_and(|g| g == "Ninja");
    let program_gone = value("CMAKE_MAKE_PROGRAM:FILEPATH=").is_some_and(|p| p.starts_with('/') && !Path::new(&p).exists());
    if was_ninja != ninja || program_gone {
        eprintln!("{}: configured for another generator; configuring again", build_dir.display());
        let _ = fs::remove_file(&cache);
        let _ = fs::remove_dir_all(build_dir.join("CMakeFiles"));
    }
}
