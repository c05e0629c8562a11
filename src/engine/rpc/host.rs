//! The host's side: which routed-expert weights llama.cpp placed on RPC
//! nodes, the claim each carries to its node, and the nodes that took them.
//! The host never reads or sends those weights' bytes.

use super::{file_id, Refusal, CLAIMED_BYTES};
use crate::engine::pager::layout::PagedTensor;
use crate::units::human;
use std::collections::{BTreeSet, HashMap};
use std::path::PathBuf;
use std::sync::Mutex;

/// One weight paged on a node: the node's endpoint, and the weight as the
/// host's loader reported it (its file is the model's own split index).
#[derive(Clone, Debug)]
struct OnNode {
    endpoint: String,
    tensor: PagedTensor,
    path: PathBuf,
}

#[derive(Default)]
struct Host {
    /// Weights placed on a node, by name, until the loader creates them.
    placed: HashMap<String, String>,
    /// Weights on nodes, by the address of the loader's tensor.
    weights: HashMap<usize, OnNode>,
    /// Nodes that took a claim: asked after each graph whether it failed.
    paging: BTreeSet<String>,
    /// Nodes holding any of the model's tensors.
    nodes: BTreeSet<String>,
    /// Nodes whose connection broke: every batch placed on them fails.
    lost: BTreeSet<String>,
}

static HOST: Mutex<Option<Host>> = Mutex::new(None);

fn with<T>(f: impl FnOnce(&mut Host) -> T) -> T {
    f(HOST.lock().unwrap_or_else(|p| p.into_inner()).get_or_insert_with(Host::default))
}

/// llama.cpp placed routed-expert weight `name` on the RPC node `endpoint`.
pub fn place(name: &str, endpoint: &str) {
    with(|h| h.placed.insert(name.to_string(), endpoint.to_string()));
}

/// The node weight `name` was placed on, if it was.
pub fn placed_on(name: &str) -> Option<String> {
    with(|h| h.placed.get(name).cloned())
}

/// The loader created weight `tensor` (at `address`), placed on `endpoint`,
/// whose bytes are in `path`.
pub fn on_weight(tensor: PagedTensor, address: usize, endpoint: String, path: PathBuf) {
    log::debug!("{} is paged on rpc node {endpoint}", tensor.name);
    if let Some(rt) = crate::engine::runtime::get() {
        rt.on_node_layer(&endpoint, tensor.layer);
    }
    with(|h| h.weights.insert(address, OnNode { endpoint, tensor, path }));
}

/// The weight at `address` named `name`, if it is one paged on a node.
/// Both must match: a dry run's tensors (common's parameter fitting loads
/// the model without memory first) are freed, and their addresses reused.
fn on_node(h: &Host, address: usize, name: &str) -> Option<OnNode> {
    h.weights.get(&address).filter(|w| w.tensor.name == name).cloned()
}

/// True if the tensor at `address` named `name` is a weight paged on a node.
pub fn is_on_node(address: usize, name: &str) -> bool {
    with(|h| on_node(h, address, name).is_some())
}

/// What the host claims of one weight for its node.
pub struct Claim {
    pub file: u32,
    pub file_id: super::FileId,
    pub offset: u64,
    pub sample_hash: u64,
}

/// What the host claims for the weight at `address` (named `name`) on `endpoint`: its
/// file index, the file's size and header fingerprint, its offset and a
/// fingerprint of its bytes. None if it is not such a weight. An
/// unreadable file is a load error.
pub fn claim(address: usize, name: &str, endpoint: &str) -> Option<Result<Claim, String>> {
    // Every tensor llama.cpp places on a node is sized here first.
    let w = with(|h| {
        if !h.nodes.contains(endpoint) {
            h.nodes.insert(endpoint.to_string());
        }
        on_node(h, address, name)
    })?;
    if w.endpoint != endpoint {
        return None;
    }
    let made = || -> crate::error::Result<Claim> {
        let file_id = file_id(&w.path)?;
        let sample_hash = super::sample_hash(&w.path, w.tensor.offset, bytes(&w.tensor))?;
        Ok(Claim { file: w.tensor.file, file_id, offset: w.tensor.offset, sample_hash })
    };
    Some(made().map_err(|e| e.to_string()))
}

/// The bytes of weight `t` in its file.
fn bytes(t: &PagedTensor) -> u64 {
    t.ty.row_size(t.ne[0]) as u64 * (t.ne[1] * t.ne[2] * t.ne[3]) as u64
}

/// The node's answer to the claim on the weight at `address` (named `name`): Ok if it
/// took it, else the error that fails the load.
pub fn claimed(address: usize, name: &str, endpoint: &str, answer: u64) -> Result<(), String> {
    let Some(w) = with(|h| on_node(h, address, name)) else { return Ok(()) };
    if answer == CLAIMED_BYTES {
        with(|h| h.paging.insert(endpoint.to_string()));
        return Ok(());
    }
    Err(match Refusal::from_answer(answer) {
        Some(r) => format!(
            "rpc node {endpoint} refuses to page {} of {} (file offset {}): {}; give that rpc-server the same model files as this host (-m), or run without --ram-budget",
            w.tensor.name,
            w.path.display(),
            w.tensor.offset,
            r.reason()
        ),
        None => format!(
            "rpc node {endpoint} does not page {}: it answered as a stock rpc-server would, which takes every expert of its layers ({} for this tensor) from this host over the network; start it as `rpc-server -m MODEL --ram-budget SIZE` with its own copy of {}, or run this host without --ram-budget",
            w.tensor.name,
            human(bytes(&w.tensor)),
            w.path.display()
        ),
    })
}

/// True if node `endpoint` pages experts (it took a claim).
pub fn node_pages(endpoint: &str) -> bool {
    with(|h| h.paging.contains(endpoint))
}

/// The connection to node `endpoint` broke.
pub fn lose(endpoint: &str) {
    with(|h| h.lost.insert(endpoint.to_string()));
}

/// Nodes lost so far, or None if no node holds a tensor of the model.
pub fn losses() -> Option<u64> {
    with(|h| (!h.nodes.is_empty()).then_some(h.lost.len() as u64))
}
