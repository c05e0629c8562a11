//! Linking: llama.cpp's static archives into every Cargo target, and
//! libllama.so/libmtmd.so with headers and pkg-config under upstream's names
//! in TARGET/PROFILE/lib and TARGET/PROFILE/include.

use std::fs;
use std::path::{Path, PathBuf};

use crate::fail;
use crate::pin::Pin;

/// Every static library the cmake build produced, sorted; at least libllama.a.
pub fn cmake_archives(build_dir: &Path) -> Vec<PathBuf> {
    let mut archives = Vec::new();
    find_archives(build_dir, &mut archives);
    archives.sort();
    if !archives.iter().any(|a| a.ends_with("libllama.a")) {
        fail(&format!("no libllama.a under {}", build_dir.display()));
    }
    archives
}

/// Links every static library the cmake build produced, as one group so their
/// order does not matter. The C++ side never references Rust symbols (hooks go
/// through a run-time table), so the group needs nothing from the rlibs.
pub fn link(archives: &[PathBuf]) {
    println!("cargo:rustc-link-arg=-Wl,--start-group");
    for a in archives {
        println!("cargo:rustc-link-arg={}", a.display());
    }
    println!("cargo:rustc-link-arg=-Wl,--end-group");
    for lib in ["stdc++", "m", "pthread", "dl"] {
        println!("cargo:rustc-link-arg=-l{lib}");
    }
    // Link arguments reach only this package's own targets; a dependent
    // (the fuzz crate) reads the archives from DEP_SDQ_LLAMA_ARCHIVES.
    let list: Vec<String> = archives.iter().map(|a| a.display().to_string()).collect();
    println!("cargo:archives={}", list.join(";"));
}

fn find_archives(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(rd) = fs::read_dir(dir) else { return };
    for entry in rd.flatten() {
        let p = entry.path();
        if p.is_dir() {
            find_archives(&p, out);
        } else if p.extension().is_some_and(|e| e == "a") {
            out.push(p);
        }
    }
}

/// libllama.so and libmtmd.so for programs that link llama.cpp (see
/// src/host/library.rs), under upstream's names, SONAMEs and versions, in
/// TARGET/PROFILE/lib with the headers beside in TARGET/PROFILE/include:
/// - libllama.so is the `sdq-libllama` target, linked here as a shared
///   object holding llama.cpp's and ggml's archives whole and exporting
///   their C API (shim/libllama.map). Cargo writes it after this script, so
///   the names are symlinks to it.
/// - libmtmd.so is cmake's (shim/CMakeLists.txt), needing libllama.so.0.
pub fn shared_libraries(root: &Path, src: &Path, build_dir: &Path, archives: &[PathBuf], pin: &Pin, lib: &Path) {
    let version = pin.llama_version.split('-').next().unwrap_or("0.0.0").to_string();
    let major = version.split('.').next().unwrap_or("0").to_string();
    let whole: Vec<&PathBuf> = archives
        .iter()
        .filter(|a| a.file_name().is_some_and(|n| ["libllama.a", "libggml.a", "libggml-base.a", "libggml-cpu.a"].contains(&n.to_string_lossy().as_ref())))
        .collect();
    if whole.len() != 4 {
        fail(&format!("expected libllama.a and ggml's three archives under {}, found {whole:?}", build_dir.display()));
    }
    let bin = "sdq-libllama";
    println!("cargo:rustc-link-arg-bin={bin}=-shared");
    println!("cargo:rustc-link-arg-bin={bin}=-Wl,-soname,libllama.so.{major}");
    println!("cargo:rustc-link-arg-bin={bin}=-Wl,--version-script={}", root.join("shim/libllama.map").display());
    println!("cargo:rustc-link-arg-bin={bin}=-Wl,--whole-archive");
    for a in &whole {
        println!("cargo:rustc-link-arg-bin={bin}={}", a.display());
    }
    println!("cargo:rustc-link-arg-bin={bin}=-Wl,--no-whole-archive");

    let _ = fs::remove_dir_all(lib);
    fs::create_dir_all(lib).unwrap_or_else(|e| fail(&format!("cannot create {}: {e}", lib.display())));
    let link = |target: &str, name: &str| {
        std::os::unix::fs::symlink(target, lib.join(name)).unwrap_or_else(|e| fail(&format!("cannot link {} in {}: {e}", name, lib.display())));
    };
    link(&format!("../{bin}"), &format!("libllama.so.{version}"));
    link(&format!("libllama.so.{version}"), &format!("libllama.so.{major}"));
    link(&format!("libllama.so.{major}"), "libllama.so");
    // cmake's: libmtmd.so, and ggml's names (empty, needing libllama.so.0).
    let ggml_version = pin.ggml_version.clone();
    let ggml_major = ggml_version.split('.').next().unwrap_or("0").to_string();
    for (name, version, major) in
        [("mtmd", &version, &major), ("ggml", &ggml_version, &ggml_major), ("ggml-base", &ggml_version, &ggml_major), ("ggml-cpu", &ggml_version, &ggml_major)]
    {
        let real = format!("lib{name}.so.{version}");
        let built = build_dir.join("shared").join(&real);
        fs::copy(&built, lib.join(&real)).unwrap_or_else(|e| fail(&format!("cannot copy {}: {e}", built.display())));
        link(&real, &format!("lib{name}.so.{major}"));
        link(&format!("lib{name}.so.{major}"), &format!("lib{name}.so"));
    }
    // pkg-config, as upstream installs it, at this directory.
    let prefix = lib.parent().unwrap_or(lib);
    fs::create_dir_all(lib.join("pkgconfig")).unwrap_or_else(|e| fail(&format!("cannot create {}/pkgconfig: {e}", lib.display())));
    let pc = format!(
        "prefix={}\nlibdir=${{prefix}}/lib\nincludedir=${{prefix}}/include\n\nName: llama\nDescription: llama.cpp {} with sdq's pager (routed experts paged under SDQ_RAM_BUDGET)\nVersion: {}\nLibs: -L${{libdir}} -lggml -lggml-base -lllama\nCflags: -I${{includedir}}\n",
        prefix.display(),
        pin.llama_version,
        pin.llama_version
    );
    fs::write(lib.join("pkgconfig/llama.pc"), pc).unwrap_or_else(|e| fail(&format!("cannot write llama.pc: {e}")));

    let include = lib.with_file_name("include");
    let _ = fs::remove_dir_all(&include);
    fs::create_dir_all(&include).unwrap_or_else(|e| fail(&format!("cannot create {}: {e}", include.display())));
    for (dir, header) in [
        ("include", "llama.h"),
        ("include", "llama-cpp.h"),
        ("ggml/include", "ggml.h"),
        ("ggml/include", "ggml-alloc.h"),
        ("ggml/include", "ggml-backend.h"),
        ("ggml/include", "ggml-cpu.h"),
        ("ggml/include", "ggml-opt.h"),
        ("ggml/include", "gguf.h"),
        ("tools/mtmd", "mtmd.h"),
        ("tools/mtmd", "mtmd-helper.h"),
    ] {
        let from = src.join(dir).join(header);
        fs::copy(&from, include.join(header)).unwrap_or_else(|e| fail(&format!("cannot copy {}: {e}", from.display())));
    }
}
