//! A node's side (`rpc-server -m FILE --ram-budget ..`): its own copy of the
//! model, the claims it takes from the host once checked against that copy,
//! and the weights it pages from it.

use super::{file_id, FileId, Refusal, CLAIMED_BYTES};
use crate::engine::ffi::ggml::{GgmlType, WeightLayout};
use crate::engine::model::gguf::{Gguf, TensorInfo};
use crate::engine::pager::layout::{PagedTensor, Part};
use crate::engine::runtime::{self, preflight};
use crate::error::Result;
use std::collections::{BTreeSet, HashMap};
use std::path::PathBuf;
use std::sync::{Mutex, OnceLock};

/// The node's copy of the model: its files and their tensors.
struct NodeModel {
    files: Vec<(PathBuf, FileId)>,
    /// Every tensor, by name: (file index, its table entry).
    tensors: HashMap<String, (u32, TensorInfo)>,
}

static MODEL: OnceLock<NodeModel> = OnceLock::new();

/// The weights this node took claims on, by name.
static CLAIMED: Mutex<BTreeSet<String>> = Mutex::new(BTreeSet::new());

/// Opens the node's copy of the model at `path` (its split parts too) and
/// registers its files with the runtime, which must be installed.
pub fn open(path: &std::path::Path) -> Result<()> {
    let check = preflight::check_model(path)?;
    let mut files = Vec::new();
    let mut tensors = HashMap::new();
    for (i, f) in check.files.iter().enumerate() {
        for t in Gguf::open(f)?.tensors() {
            tensors.insert(t.name.clone(), (i as u32, t));
        }
        files.push((f.clone(), file_id(f)?));
    }
    let rt = runtime::get().expect("the node's runtime is installed first");
    for (i, (f, _)) in files.iter().enumerate() {
        rt.on_loader_file(i as u32, f.clone());
    }
    // No llama_model: the node's copy is never freed (0 stands for it).
    rt.on_model_loaded(0);
    log::info!("pages the routed experts the host claims from {} ({} files, {} expert tensors)", path.display(), files.len(), check.routed_expert_tensors);
    let _ = MODEL.set(NodeModel { files, tensors });
    Ok(())
}

/// What the host claims of one weight: its name, type and shape as they
/// came over the wire, and where its bytes are in the host's copy.
pub struct Claim<'a> {
    pub name: &'a str,
    pub ty: GgmlType,
    pub ne: [i64; 4],
    pub file: u32,
    pub file_id: FileId,
    pub offset: u64,
    pub sample_hash: u64,
}

/// The node's answer to a claim: [`CLAIMED_BYTES`] once the weight is
/// registered for paging here, else a [`Refusal`] (said on stderr, naming
/// this node's file).
pub fn claim(c: &Claim) -> u64 {
    match check(c) {
        Ok(()) => CLAIMED_BYTES,
        Err((r, detail)) => {
            let file = MODEL.get().and_then(|m| m.files.get(c.file as usize)).or_else(|| MODEL.get().and_then(|m| m.files.first()));
            stderr_line!(
                "sdq: error: refused the host's claim on {}: {}{} (this node's model: {})",
                c.name,
                r.reason(),
                detail,
                file.map_or_else(|| "none".to_string(), |(p, _)| p.display().to_string())
            );
            r as u64
        }
    }
}

fn check(c: &Claim) -> Result<(), (Refusal, String)> {
    let model = MODEL.get().ok_or((Refusal::NotPageable, String::new()))?;
    let (layer, part) = Part::from_tensor_name(c.name).ok_or((Refusal::NotPageable, " (not a routed expert)".to_string()))?;
    let (_, id) = model.files.get(c.file as usize).ok_or((Refusal::NoSuchFile, format!(" (file {} of {})", c.file + 1, model.files.len())))?;
    if id.size != c.file_id.size {
        return Err((Refusal::FileSize, format!(" ({} bytes here, {} on the host)", id.size, c.file_id.size)));
    }
    if id.header_hash != c.file_id.header_hash {
        return Err((Refusal::Header, String::new()));
    }
    let (file, t) = model.tensors.get(c.name).ok_or((Refusal::Tensor, String::new()))?;
    if *file != c.file || t.offset != c.offset || t.ty != c.ty || t.ne != c.ne {
        return Err((Refusal::Tensor, format!(" (here: file {}, offset {}, {} {:?})", file + 1, t.offset, t.ty.name(), t.ne)));
    }
    let (path, _) = &model.files[c.file as usize];
    match super::sample_hash(path, t.offset, t.size) {
        Ok(h) if h == c.sample_hash => {}
        Ok(_) => return Err((Refusal::Bytes, String::new())),
        Err(e) => return Err((Refusal::NotPageable, format!(" ({e})"))),
    }
    let mut claimed = CLAIMED.lock().unwrap_or_else(|p| p.into_inner());
    if claimed.contains(c.name) {
        return Ok(());
    }
    let rt = runtime::get().ok_or((Refusal::NotPageable, String::new()))?;
    if rt.pager_ready().is_some() {
        // The arena was planned for the layers of the hosts before.
        return Err((
            Refusal::NotPageable,
            " (this rpc-server's arena is planned for the layers its earlier hosts placed here; restart it for another split)".to_string(),
        ));
    }
    // Stock's rpc-server holds weights in ggml-cpu's plain buffer: that layout.
    rt.is_paged(c.name, c.ty, WeightLayout::Plain, None).map_err(|e| (Refusal::NotPageable, format!(" ({e})")))?;
    let ts = c.ty.row_size(c.ne[0]);
    let nb = [c.ty.row_size(c.ty.block_size()), ts, ts * c.ne[1] as usize, ts * (c.ne[1] * c.ne[2]) as usize];
    // The registry knows weights by the loader's tensor; here there is none,
    // so each takes a number of its own, never a tensor's address.
    let key = claimed.len() + 1;
    rt.on_paged_weight(
        PagedTensor { name: c.name.to_string(), layer, part, ty: c.ty, ne: c.ne, nb, file: c.file, offset: c.offset, layout: WeightLayout::Plain },
        key,
    );
    claimed.insert(c.name.to_string());
    Ok(())
}

/// The bytes weight `name` takes in its RPC buffer here: [`CLAIMED_BYTES`]
/// for a claimed one, None for any other tensor.
pub fn weight_bytes(name: &str) -> Option<u64> {
    CLAIMED.lock().unwrap_or_else(|p| p.into_inner()).contains(name).then_some(CLAIMED_BYTES)
}
