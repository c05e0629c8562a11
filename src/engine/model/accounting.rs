//! The bytes a model's parts take once a tool loads them, where the file's
//! sizes alone do not say: today the projector (`--mmproj`), whose compute
//! buffers mtmd sizes. The runtime counts it before planning the arena, and
//! `sdq inspect` counts the same.

use crate::engine::model::gguf::Gguf;
use crate::error::{Error, Result};
use std::path::{Path, PathBuf};

/// A projector file's memory once a tool loads it (see [`projector_memory`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Projector {
    pub path: PathBuf,
    /// `clip.projector_type`, e.g. `minicpmv4_6`.
    pub kind: String,
    pub weights: u64,
    pub compute: u64,
}

/// Reads `path` as a projector: its weights from the file, its compute
/// buffers from mtmd (sized for its largest input, no tensor data read).
/// `sdq inspect --mmproj` and a tool's run (before the arena) count the same.
pub fn projector_memory(path: &Path) -> Result<Projector> {
    let g = Gguf::open(path)?;
    let kind = g.get("clip.projector_type").and_then(|v| v.as_str().map(str::to_string));
    let Some(kind) = kind.or_else(|| g.get("clip.vision.projector_type").and_then(|v| v.as_str().map(str::to_string))) else {
        return Err(Error::gguf(path, "is not a projector (no clip.projector_type): pass the text model as MODEL and the mmproj file as --mmproj"));
    };
    let weights = g.tensors().iter().map(|t| t.size).sum();
    let total = crate::engine::ffi::llama::projector_memory(path).ok_or_else(|| Error::gguf(path, format!("mtmd cannot load this {kind} projector")))?;
    Ok(Projector { path: path.to_path_buf(), kind, weights, compute: total.saturating_sub(weights) })
}
