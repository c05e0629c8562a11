//! The patched tree: the vendored llama.cpp copied, patches/*.patch applied
//! in order, and synced into TARGET/llama/llama.cpp (or
//! SDQ_LLAMA_BUILD_DIR/llama.cpp) rewriting only the files that differ.

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::fail;

/// Top-level entries of the llama.cpp tree the build never needs (models,
/// docs, tests, …); leaving them out keeps the copy small.
const SKIP_TOP_LEVEL: &[&str] =
    &["models", "docs", "media", "gguf-py", "tests", "benches", "examples", "pocs", ".github", "conversion", "requirements", "grammars", "skills", ".sdq-pin"];

/// Copies the vendored tree into a staging directory, applies patches/*.patch
/// in order, then syncs the result into `out`/llama.cpp, rewriting only
/// files whose bytes differ (so unchanged files keep their mtimes).
pub fn stage_patched(root: &Path, vendor: &Path, out: &Path, ui: Option<&Path>) -> PathBuf {
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

pub fn copy_tree(from: &Path, to: &Path, top: bool) {
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
