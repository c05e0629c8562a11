//! What sdq checks about a model before a tool loads it under a budget:
//! the file (and every part of a split GGUF) exists, is a GGUF that ggml's
//! reader accepts, and holds every tensor's bytes; and whether it has routed
//! experts to page at all. Problems become one line naming the file and what
//! is wrong, instead of a page of loader errors or, worse, a run that pages
//! garbage.

use crate::engine::model::gguf::Gguf;
use crate::engine::pager::layout::Part;
use crate::error::{Error, Result};
use std::io::Read;
use std::path::{Path, PathBuf};

/// What the check found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelCheck {
    /// Every file of the model (one, or each part of a split GGUF).
    pub files: Vec<PathBuf>,
    /// Routed-expert tensors across all files.
    pub routed_expert_tensors: usize,
    /// One sequence's recurrent state (`growth::checkpoint_bytes`).
    pub checkpoint_bytes: u64,
    /// The context the model was trained with (`{arch}.context_length`),
    /// which llama.cpp takes where `-c` is not given (before fitting it).
    pub trained_context: Option<u64>,
}

/// Checks the model at `path` (the first part, for a split GGUF).
pub fn check_model(path: &Path) -> Result<ModelCheck> {
    let first = check_file(path)?;
    let count = match first.get("split.count") {
        Some(v) => v.as_u64().ok_or_else(|| Error::gguf(path, "split.count is not a number"))?,
        None => 1,
    };
    let mut files = vec![path.to_path_buf()];
    let mut routed = count_routed(&first);
    if routed > 0 {
        check_expert_counts(path, &first)?;
    }
    let checkpoint_bytes = crate::engine::memory::growth::checkpoint_bytes(&first);
    let trained_context = first.arch_u64("context_length");
    if count > 1 {
        let prefix = split_prefix(path, count)
            .ok_or_else(|| Error::gguf(path, format!("a split GGUF of {count} parts must be named PREFIX-00001-of-{count:05}.gguf")))?;
        for i in 2..=count {
            let part = PathBuf::from(format!("{prefix}-{i:05}-of-{count:05}.gguf"));
            if !part.exists() {
                return Err(Error::gguf(path, format!("split part {i} of {count} is missing: {}", part.display())));
            }
            let g = check_file(&part)?;
            // A part of another split (another model, or another way of
            // splitting it) would give llama.cpp tensors of the wrong shape
            // or none at all; the numbers each part carries say so first.
            let field = |k: &str| g.get(k).and_then(|v| v.as_u64());
            let total = first.get("split.tensors.count").and_then(|v| v.as_u64());
            if field("split.no") != Some(i - 1) || field("split.count") != Some(count) || field("split.tensors.count") != total {
                let says = match (field("split.no"), field("split.count"), field("split.tensors.count")) {
                    (Some(no), Some(n), _) if no + 1 != i || n != count => format!("it says it is part {} of {n}", no + 1),
                    (Some(_), Some(_), t) => format!(
                        "it belongs to a split of {} tensors, the first part to one of {}",
                        t.map_or("an unknown number of".into(), |t| t.to_string()),
                        total.map_or("an unknown number of".into(), |t| t.to_string())
                    ),
                    _ => "it has no split.no/split.count".to_string(),
                };
                return Err(Error::gguf(path, format!("split part {i} of {count} does not belong to this model: {} ({says})", part.display())));
            }
            routed += count_routed(&g);
            files.push(part);
        }
    }
    Ok(ModelCheck { files, routed_expert_tensors: routed, checkpoint_bytes, trained_context })
}

/// `PREFIX` of `PREFIX-00001-of-0000N.gguf`.
fn split_prefix(path: &Path, count: u64) -> Option<String> {
    let s = path.to_str()?;
    s.strip_suffix(&format!("-00001-of-{count:05}.gguf")).map(str::to_string)
}

/// The routing metadata a model with routed experts needs: an expert count,
/// and between 1 and that many experts used per token. llama.cpp would abort
/// on these at load; sdq's own accounting divides and clamps by them first.
pub fn check_expert_counts(path: &Path, g: &Gguf) -> Result<()> {
    let arch = g.architecture().ok_or_else(|| Error::gguf(path, "has routed-expert tensors but no general.architecture"))?;
    let key = |k: &str| {
        let name = format!("{arch}.{k}");
        match g.get(&name) {
            Some(v) => v.as_u64().ok_or_else(|| Error::gguf(path, format!("{name} is not a whole number"))).map(|n| (name, n)),
            None => Err(Error::gguf(path, format!("has routed-expert tensors but no {name}"))),
        }
    };
    let (count_key, count) = key("expert_count")?;
    let (used_key, used) = key("expert_used_count")?;
    if used == 0 || used > count {
        return Err(Error::gguf(path, format!("{used_key} is {used}: it must be between 1 and {count_key} ({count})")));
    }
    for t in g.tensors() {
        if Part::from_tensor_name(&t.name).is_some() && t.ne[2] as u64 != count {
            return Err(Error::gguf(path, format!("tensor {} holds {} experts, but {count_key} is {count}", t.name, t.ne[2])));
        }
    }
    Ok(())
}

fn count_routed(g: &Gguf) -> usize {
    g.tensors().iter().filter(|t| Part::from_tensor_name(&t.name).is_some()).count()
}

/// One GGUF file: readable, the right magic, accepted by ggml's reader, and
/// long enough for every tensor it describes.
fn check_file(path: &Path) -> Result<Gguf> {
    let meta = std::fs::metadata(path).map_err(|e| Error::io("cannot open model", path, e))?;
    if !meta.is_file() {
        return Err(Error::gguf(path, "not a regular file"));
    }
    let mut magic = [0u8; 4];
    let mut f = std::fs::File::open(path).map_err(|e| Error::io("cannot open model", path, e))?;
    f.read_exact(&mut magic).map_err(|_| Error::gguf(path, format!("only {} bytes: too short for a GGUF file", meta.len())))?;
    if &magic != b"GGUF" {
        return Err(Error::gguf(path, format!("not a GGUF file (starts with {:?}, not \"GGUF\")", String::from_utf8_lossy(&magic))));
    }
    let g = Gguf::open(path)?;
    let len = meta.len();
    for t in g.tensors() {
        let end = t.offset.saturating_add(t.size);
        if end > len {
            return Err(Error::gguf(path, format!("tensor {} runs to byte {end}, past the end of the file ({len} bytes): truncated or corrupt", t.name)));
        }
    }
    if let Some(arch) = g.architecture() {
        log::debug!("{}: {arch}, {} tensors", path.display(), g.tensors().len());
    }
    Ok(g)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_names() {
        assert_eq!(split_prefix(Path::new("/m/x-00001-of-00003.gguf"), 3).as_deref(), Some("/m/x"));
        assert_eq!(split_prefix(Path::new("/m/x-00002-of-00003.gguf"), 3), None);
        assert_eq!(split_prefix(Path::new("/m/x.gguf"), 3), None);
    }
}
