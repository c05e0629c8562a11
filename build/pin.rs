//! The pin (vendor/llama.cpp.pin) and the pinned llama.cpp source: read
//! from vendor/llama.cpp, fetched there once (scripts/fetch-llama.sh, from
//! PyPI) when it is missing or from another pin. Nothing else is written.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::fail;

/// The fields of vendor/llama.cpp.pin that the build uses.
pub struct Pin {
    pub commit: String,
    /// llama.cpp's version (`0.5.0-dev`): its libraries' VERSION and SOVERSION.
    pub llama_version: String,
    /// ggml's (`0.25.3`), for its libraries' names.
    pub ggml_version: String,
}

impl Pin {
    pub fn read(path: &Path) -> Pin {
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

/// Returns the extracted vendor tree, fetching it once if it is missing or
/// from another pin.
pub fn ensure_vendor(root: &Path) -> PathBuf {
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
