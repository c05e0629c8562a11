//! Builds the pinned llama.cpp with sdq's patches and links it into this
//! crate. The steps, each a module of build/ (what it reads, what it writes):
//!
//! 1. [`pin`]: vendor/llama.cpp.pin, and the source in vendor/llama.cpp,
//!    fetched there once if missing (scripts/fetch-llama.sh).
//! 2. [`build_tools`]: cmake, libclang and Node.js, the machine's or fetched
//!    from pinned wheels into TARGET/build-tools.
//! 3. [`ui`]: llama-server's chat page, built with npm into TARGET/ui.
//! 4. [`tree`]: the vendored tree copied and patched (patches/) into
//!    TARGET/llama/llama.cpp, rewriting only files whose bytes changed, so
//!    cmake rebuilds only what a patch touched.
//! 5. [`cmake`]: llama.cpp and the hook table built into TARGET/llama/build.
//! 6. [`bindings`]: the tool shims (cc) and OUT_DIR/bindings.rs (bindgen).
//! 7. [`link`]: the archives into every target; libllama.so, libmtmd.so,
//!    headers and llama.pc into TARGET/PROFILE/{lib,include}.
//!
//! The patched tree, the cmake build, the tools and the page live beside
//! the profiles, not in OUT_DIR: every profile and target directory (the
//! fuzz crate's, with SDQ_LLAMA_BUILD_DIR) shares one llama.cpp build, so
//! the README's two commands compile it once. The source tree is never
//! modified. This script reruns only when the pin, the patches, the shims,
//! the build steps or the variables below change, never for a Rust-only edit.

// A build script's stderr is cargo's: no llama.cpp thread writes into it.
#![allow(clippy::disallowed_macros)]

#[path = "build/bindings.rs"]
mod bindings;
#[path = "build/build_tools.rs"]
mod build_tools;
#[path = "build/cmake.rs"]
mod cmake;
#[path = "build/link.rs"]
mod link;
#[path = "build/pin.rs"]
mod pin;
#[path = "build/tree.rs"]
mod tree;
#[path = "build/ui.rs"]
mod ui;

use std::env;
use std::fs;
use std::path::{Path, PathBuf};
use std::process;
use std::thread;

use build_tools::BuildTools;
use pin::Pin;

fn main() {
    let root = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap());
    let out = PathBuf::from(env::var("OUT_DIR").unwrap());

    // The extracted tree derives from the pin, and a first build writes it
    // during this run: watching it would rerun this script on the next build.
    for path in ["build.rs", "build", "patches", "shim", "vendor/llama.cpp.pin", "vendor/build-tools.pin"] {
        println!("cargo:rerun-if-changed={}", root.join(path).display());
    }
    for var in ["SDQ_GGML_NATIVE", "SDQ_GGML_AMX", "SDQ_CMAKE_JOBS", "SDQ_LLAMA_BUILD_DIR", "CFLAGS", "CXXFLAGS", "CC", "CXX", "CMAKE"] {
        println!("cargo:rerun-if-env-changed={var}");
    }

    let pin = Pin::read(&root.join("vendor/llama.cpp.pin"));
    // `--version` of every tool names the pinned llama.cpp.
    println!("cargo:rustc-env=SDQ_LLAMA_COMMIT={}", pin.commit);
    let vendor = pin::ensure_vendor(&root);
    // SDQ_LLAMA_BUILD_DIR shares one patched tree and cmake build between
    // target directories (the fuzz crate's, the tests'): the cmake flags do
    // not depend on the Cargo profile, so a second build finds it done.
    // By default it is TARGET/llama, one for every profile of this target
    // directory: the README's two commands build llama.cpp once.
    let work = env::var_os("SDQ_LLAMA_BUILD_DIR").map_or_else(|| target_dir(&out).join("llama"), PathBuf::from);
    fs::create_dir_all(&work).unwrap_or_else(|e| fail(&format!("cannot create {}: {e}", work.display())));
    // The fetched build tools and the built chat page sit beside that build
    // (TARGET/build-tools and TARGET/ui by default), so a shared build shares
    // them too: the fuzz crate's build otherwise fetched libclang and built
    // the page again (its build in CI: 271 s with them, 111 s without).
    let beside = work.parent().filter(|p| !p.as_os_str().is_empty()).map_or_else(|| target_dir(&out), Path::to_path_buf);
    let tools = BuildTools::read(&root.join("vendor/build-tools.pin"), &beside.join("build-tools"));
    // The cmake crate runs $CMAKE, else `cmake` from PATH.
    if let Some(exe) = tools.cmake() {
        env::set_var("CMAKE", exe);
    }
    let clang_includes = tools.libclang();
    let ui_cache = beside.join("ui");
    let (src, build_dir) = if ui::is_built(&ui_cache, &ui::key(&root)) {
        let ui = ui::provision(&root, &vendor, &tools, &ui_cache);
        let src = tree::stage_patched(&root, &vendor, &work, ui.as_deref());
        let build_dir = cmake::build(&root, &src, &pin, &work, "sdq-tools");
        (src, build_dir)
    } else {
        // A first build: the chat page (a Node.js fetch, npm's packages and
        // Vite, about two minutes on 2 cores, much of it waiting on the
        // network) builds while cmake compiles everything but the server
        // and the CLI, which embed the page; they follow once it is there.
        thread::scope(|s| {
            let page = s.spawn(|| ui::provision(&root, &vendor, &tools, &ui_cache));
            let src = tree::stage_patched(&root, &vendor, &work, None);
            cmake::build(&root, &src, &pin, &work, "sdq-tools-but-server");
            let ui = page.join().unwrap_or_else(|_| fail("building llama-server's chat page panicked"));
            if let Some(ui) = &ui {
                tree::copy_tree(ui, &src.join("tools/ui/dist"), false);
            }
            let build_dir = cmake::build(&root, &src, &pin, &work, "sdq-tools");
            (src, build_dir)
        })
    };
    bindings::compile_shims(&root);
    bindings::generate(&root, &src, &out, clang_includes.as_deref());
    // Before link()'s: the linker takes arguments in order, and the shared
    // library's whole archives must come before the group that loads parts
    // of the same archives for every other target.
    let archives = link::cmake_archives(&build_dir);
    link::shared_libraries(&root, &src, &build_dir, &archives, &pin, &out.ancestors().nth(3).unwrap_or(&out).join("lib"));
    link::link(&archives);
}

/// Cargo's target directory: OUT_DIR is TARGET/PROFILE/build/PKG-HASH/out.
fn target_dir(out: &Path) -> PathBuf {
    out.ancestors().nth(4).map_or_else(|| out.to_path_buf(), Path::to_path_buf)
}

/// Stops the build with one clear message (no panic backtrace).
pub fn fail(msg: &str) -> ! {
    eprintln!("error: {msg}");
    println!("cargo:warning={}", msg.lines().next().unwrap_or(msg));
    process::exit(1);
}
