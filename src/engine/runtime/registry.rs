//! What the loader reported: each model the process opened, its files, and
//! its paged, mapped and resident weights, numbered as the pager knows them.

use crate::engine::ffi::ggml::WeightLayout;
use crate::engine::pager::layout::PagedTensor;
use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

#[derive(Default)]
pub(super) struct Registry {
    pub(super) files: BTreeMap<u32, PathBuf>,
    pub(super) tensors: BTreeMap<String, PagedTensor>,
    /// Weights the loader left in the file mapping: (name, bytes).
    pub(super) mapped: Vec<(String, u64)>,
    /// Each layer's router (`blk.N.ffn_gate_inp.weight`), for predicting the
    /// next layer's experts: the loader's tensor, as an address.
    pub(super) routers: BTreeMap<u32, usize>,
    /// The layout stock gives each paged weight (plain or repacked), by name.
    pub(super) layouts: BTreeMap<String, WeightLayout>,
    /// Notices about layouts already printed.
    pub(super) layout_notices: BTreeSet<String>,
    /// The models the loader opened, in load order, and the one loading now.
    pub(super) models: Vec<LoadedModel>,
    pub(super) current: usize,
    /// Each paged weight's layer as the pager numbers it, by the address of
    /// the loader's tensor (the graph's expert ops see that tensor).
    pub(super) weights: std::collections::HashMap<usize, u32>,
    /// Layers whose experts RPC nodes page: endpoint → (first, last).
    pub(super) on_nodes: BTreeMap<String, (u32, u32)>,
}

/// A model the process loaded (a draft model, `-md`, beside the target).
/// The pager knows experts by layer and reads by file index, so each model's
/// layers and files are numbered after those of the models loaded before it:
/// a draft's `blk.0` is the pager's layer `layer_base`. The first model's
/// numbers are its own.
#[derive(Clone, Debug)]
pub(super) struct LoadedModel {
    /// Its first file, as the tool named it.
    pub(super) path: PathBuf,
    /// Its weights are in memory (not only a dry run's metadata).
    pub(super) loaded: bool,
    pub(super) layer_base: u32,
    pub(super) file_base: u32,
}

/// `name` with its layer (`blk.N.`) moved up by `base`: the name the pager
/// and the stats give a later model's weight.
pub(crate) fn renumbered(name: &str, base: u32) -> String {
    let Some((n, rest)) = name.strip_prefix("blk.").and_then(|r| r.split_once('.')) else { return name.to_string() };
    match n.parse::<u32>() {
        Ok(layer) if base > 0 => format!("blk.{}.{rest}", layer + base),
        _ => name.to_string(),
    }
}

impl Registry {
    /// The model loading now (the first one before any file is opened).
    pub(super) fn loading(&self) -> LoadedModel {
        self.models.get(self.current).cloned().unwrap_or(LoadedModel { path: PathBuf::new(), loaded: false, layer_base: 0, file_base: 0 })
    }

    /// The pager's layers of the model that holds pager layer `layer`.
    pub(super) fn model_layers(&self, layer: u32) -> std::ops::Range<u32> {
        let base = self.models.iter().map(|m| m.layer_base).filter(|&b| b <= layer).max().unwrap_or(0);
        let end = self.models.iter().map(|m| m.layer_base).filter(|&b| b > base).min().unwrap_or(u32::MAX);
        base..end
    }

    /// Bytes of mapped weights each token reads: all but one `token_embd.weight`,
    /// the input embedding, which `get_rows` reads a row per token. (A model
    /// with tied embeddings maps it twice, once as the output: that one counts.)
    pub(super) fn mapped_hot_bytes(&self) -> u64 {
        let total: u64 = self.mapped.iter().map(|(_, b)| b).sum();
        let embd = self.mapped.iter().find(|(n, _)| n == "token_embd.weight").map_or(0, |(_, b)| *b);
        total - embd
    }
}
