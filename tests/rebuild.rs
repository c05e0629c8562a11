//! A Rust-only change rebuilds Rust only: neither the build script nor
//! llama.cpp's cmake build runs again. (Its own test binary, because it
//! relinks `sdq` while no other test is running one.)

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::SystemTime;

fn archives(dir: &Path, out: &mut Vec<(PathBuf, SystemTime)>) {
    let Ok(rd) = std::fs::read_dir(dir) else { return };
    for e in rd.flatten() {
        let p = e.path();
        if p.is_dir() {
            archives(&p, out);
        } else if p.extension().is_some_and(|x| x == "a") || p.file_name().is_some_and(|n| n == ".ninja_log") {
            out.push((p.clone(), e.metadata().unwrap().modified().unwrap()));
        }
    }
}

#[test]
fn touching_a_rust_source_does_not_rebuild_llama_cpp() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    // scripts/test names the llama.cpp build with SDQ_LLAMA_BUILD_DIR; by
    // default it is TARGET/llama (the binary is TARGET/release/sdq).
    let build_dir = match std::env::var_os("SDQ_LLAMA_BUILD_DIR") {
        Some(d) => PathBuf::from(d),
        None => Path::new(env!("CARGO_BIN_EXE_sdq")).parent().unwrap().parent().unwrap().join("llama"),
    };
    let mut before = Vec::new();
    archives(&build_dir, &mut before);
    assert!(before.iter().any(|(p, _)| p.ends_with("libllama.a")), "no libllama.a under {}", build_dir.display());

    let src = root.join("src/error.rs");
    std::fs::File::options().append(true).open(&src).unwrap().set_modified(SystemTime::now()).unwrap();

    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let o = Command::new(cargo).args(["build", "--release", "--bin", "sdq", "-v"]).current_dir(root).env("CARGO_TERM_COLOR", "never").output().unwrap();
    let log = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "cargo build failed:\n{log}");
    assert!(log.contains("Compiling sdq") || log.contains("Running `"), "the touched source was not rebuilt:\n{log}");
    assert!(!log.contains("build-script-build`"), "the build script ran again:\n{log}");

    let mut after = Vec::new();
    archives(&build_dir, &mut after);
    assert_eq!(before, after, "llama.cpp's static libraries or ninja log changed");
}
