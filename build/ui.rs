//! llama-server's chat page: the pinned tools/ui with its patches, built
//! with npm into TARGET/ui/dist once and reused offline after.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::build_tools::{BuildTools, Node};
use crate::tree::copy_tree;

/// llama-server's chat page: the pinned tree's `tools/ui` (a Svelte app)
/// built with npm from its lockfile into `cache/dist`, once; later builds
/// reuse it offline. Without npm, or when npm fails, one warning says the
/// page is left out and why, and every tool still builds (llama-server then
/// answers `/` with 404, as upstream's does built without its UI).
pub fn provision(root: &Path, vendor: &Path, tools: &BuildTools, cache: &Path) -> Option<PathBuf> {
    let dist = cache.join("dist");
    let key = key(root);
    let key_file = cache.join("dist.key");
    let node = tools.node();
    if let Ok(node) = &node {
        // The tests drive the page in a browser with the same Node.js.
        println!("cargo:rustc-env=SDQ_NODE={}", node.node.display());
    }
    if is_built(cache, &key) {
        return Some(dist);
    }
    let built = node.and_then(|node| build(&vendor.join("tools/ui"), &patches(root), cache, &dist, &node));
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
pub fn key(root: &Path) -> String {
    let mut key = fs::read(root.join("vendor/llama.cpp.pin")).unwrap_or_default();
    for p in &patches(root) {
        key.extend(fs::read(p).unwrap_or_default());
    }
    format!("{:016x}\n", fnv1a(&key))
}

/// True when `cache` holds the page built from what `key` (`key`) names.
pub fn is_built(cache: &Path, key: &str) -> bool {
    cache.join("dist/index.html").is_file() && fs::read_to_string(cache.join("dist.key")).ok().as_deref() == Some(key)
}

/// The patches that change the chat page's source (they name tools/ui/).
fn patches(root: &Path) -> Vec<PathBuf> {
    let mut patches: Vec<PathBuf> = fs::read_dir(root.join("patches")).into_iter().flatten().flatten().map(|e| e.path()).collect();
    patches.retain(|p| p.extension().is_some_and(|e| e == "patch") && fs::read_to_string(p).is_ok_and(|t| t.contains("\n+++ b/tools/ui/")));
    patches.sort();
    patches
}

/// FNV-1a: a stable fingerprint of what the page is built from.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
}

fn build(ui: &Path, patches: &[PathBuf], cache: &Path, dist: &Path, node: &Node) -> Result<(), String> {
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
