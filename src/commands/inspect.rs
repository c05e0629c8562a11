//! `sdq inspect`: a model's memory accounting from its own metadata: routed
//! experts against what stays resident, per-layer expert types and sizes, the
//! slot classes, one token's working set, and how a RAM budget would be split.
//!
//! Just over 600 lines: the accounting (model metadata, context and process
//! memory, slots, the budget's split) and its two renderings, JSON and text,
//! which read the same figures.

use crate::engine::ffi::ggml::WeightLayout;
use crate::engine::memory::budget;
use crate::engine::model::accounting::projector_memory;
use crate::engine::model::gguf::{Gguf, TensorInfo};
use crate::engine::pager::arena::slot_bytes;
use crate::engine::pager::layout::{Layout, PagedTensor, Part};
use crate::error::{Error, Result};
use crate::units::{human, MIB};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The resident (non-expert) categories, in report order.
const CATEGORIES: &[&str] = &["token_embd", "output", "attention", "linear_attention", "shared_expert", "router", "norms", "other"];

fn category(name: &str) -> &'static str {
    // blk.N.<leaf> for layer tensors, the whole name otherwise
    let leaf = name.strip_prefix("blk.").and_then(|r| r.split_once('.')).map_or(name, |(_, rest)| rest);
    match () {
        _ if name.starts_with("token_embd") => "token_embd",
        _ if name.starts_with("output.") => "output",
        _ if leaf.contains("norm") => "norms",
        _ if leaf.contains("shexp") => "shared_expert",
        _ if leaf.starts_with("ffn_gate_inp") => "router",
        _ if leaf.starts_with("ssm_") || leaf.starts_with("attn_qkv") || leaf.starts_with("attn_gate") => "linear_attention",
        _ if leaf.starts_with("attn_") => "attention",
        _ => "other",
    }
}

/// The layer of a `blk.N.*` tensor.
fn layer_of(name: &str) -> Option<u32> {
    name.strip_prefix("blk.")?.split_once('.')?.0.parse().ok()
}

/// Process memory besides weights and context, measured on the pinned build
/// (tests/it/inspect.rs checks the estimate against runs): a fixed part, and
/// the tokenizer's tables, which grow with its tokens and its BPE merges.
/// Fitted on seven tokenizers the pinned tree ships (SentencePiece 32,000
/// and 32,064 tokens; BPE 50,257 to 201,088 tokens with 0 to 280,147
/// merges): every estimate within 1.6 MiB of the run's. One rate per token
/// alone was off by up to 18 MiB (over on SentencePiece, under on Llama 3's).
const PROCESS_BASE_BYTES: u64 = 2 * MIB;
const PROCESS_BYTES_PER_TOKEN: u64 = 244;
const PROCESS_BYTES_PER_MERGE: u64 = 101;
/// What a hybrid (linear-attention) model's context holds beyond its state,
/// not counting the compute buffers (counted apart): 7.1 MiB on the
/// generated `qwen35moe` family model, from the process's anonymous memory
/// when its context had reserved them. (16 MiB was measured with the pages
/// the warm-up batch touches in the compute buffers, now counted with them.)
const RECURRENT_BATCH_BYTES: u64 = 7 * MIB;

/// The metadata the context estimate needs.
#[derive(Clone)]
struct ModelMeta {
    /// Layers of the trunk (block_count less NextN blocks): the layers a run
    /// loads, unless it drafts with MTP.
    n_trunk: u32,
    /// block_count, NextN blocks included.
    n_blocks: u32,
    n_ctx: u64,
    n_vocab: u64,
    /// BPE merges (none for SentencePiece).
    n_merges: u64,
    arch: String,
}

impl ModelMeta {
    fn read(g: &Gguf, arch: &str) -> ModelMeta {
        let key = |k: &str| g.arch_u64(k);
        let blocks = key("block_count").unwrap_or(0) as u32;
        let entries = |k: &str| match g.get(k) {
            Some(crate::engine::model::gguf::Value::Array(a)) => a.len() as u64,
            _ => 0,
        };
        let (n_vocab, n_merges) = (entries("tokenizer.ggml.tokens"), entries("tokenizer.ggml.merges"));
        ModelMeta {
            n_trunk: blocks.saturating_sub(key("nextn_predict_layers").unwrap_or(0) as u32),
            n_blocks: blocks,
            n_ctx: key("context_length").unwrap_or(4096),
            n_vocab,
            n_merges,
            arch: arch.to_string(),
        }
    }

    /// The compute buffers a context of this model (`path`) at these batch
    /// sizes uses for a full ubatch asking one output, as a run counts them
    /// (a generating tool asks for the last token's logits only). A file
    /// llama.cpp cannot make a context of (it names why on stderr) is still
    /// accounted for from its metadata, without them.
    fn compute_bytes(&self, path: &Path, n_batch: u32, n_ubatch: u32) -> u64 {
        let n_ctx = u32::try_from(self.n_ctx).unwrap_or(u32::MAX);
        crate::engine::ffi::llama::context_compute_bytes(path, n_ctx, n_batch, n_ubatch).unwrap_or(0)
    }

    /// KV cache (f16, padded to 256 cells; sliding-window layers hold the
    /// window and one batch; latent attention caches its compressed key),
    /// recurrent state, and the process.
    fn context_bytes(&self, names: &[&str], g: &Gguf) -> u64 {
        let key = |k: &str| g.arch_u64(k);
        let n_head = key("attention.head_count").unwrap_or(1);
        let n_head_kv = key("attention.head_count_kv").unwrap_or(n_head);
        let n_embd = key("embedding_length").unwrap_or(0);
        let k_len = key("attention.key_length").unwrap_or(n_embd / n_head.max(1));
        let v_len = key("attention.value_length").unwrap_or(k_len);
        let window = key("attention.sliding_window");
        let swa_pattern = match g.get(&format!("{}.attention.sliding_window_pattern", self.arch)) {
            Some(crate::engine::model::gguf::Value::Array(crate::engine::model::gguf::Array::Bool(v))) => Some(v),
            _ => None,
        };
        let cells = |n: u64| n.div_ceil(256).saturating_mul(256);
        // What each trunk layer has, from one pass over the tensor names
        // (never a loop over block_count, which a file may set to anything).
        #[derive(Default)]
        struct Kind {
            latent: bool,
            attention: bool,
            fused_qkv: bool,
            recurrent: bool,
        }
        let mut layers: BTreeMap<u32, Kind> = BTreeMap::new();
        for name in names {
            let Some(il) = layer_of(name).filter(|&l| l < self.n_trunk) else { continue };
            let leaf = name.split_once('.').and_then(|(_, r)| r.split_once('.')).map_or("", |(_, leaf)| leaf);
            let k = layers.entry(il).or_default();
            k.latent |= leaf == "attn_kv_a_mqa.weight";
            k.attention |= matches!(leaf, "attn_k.weight" | "attn_q.weight");
            k.fused_qkv |= leaf == "attn_qkv.weight";
            k.recurrent |= leaf.starts_with("ssm_");
        }
        let mut kv: u64 = 0;
        for (&il, k) in &layers {
            let per_token = if k.latent {
                k_len.saturating_mul(2)
            } else if k.attention || (k.fused_qkv && !k.recurrent) {
                n_head_kv.saturating_mul(k_len.saturating_add(v_len)).saturating_mul(2)
            } else {
                0
            };
            // gpt-oss alternates sliding and full layers from the first;
            // Gemma 4 lists them.
            let swa = match (&swa_pattern, window) {
                (Some(p), Some(_)) => p.get(il as usize).copied().unwrap_or(false),
                (None, Some(_)) => il % 2 == 0,
                _ => false,
            };
            let n = if swa { cells(self.n_ctx.min(window.unwrap_or(0).saturating_add(512))) } else { cells(self.n_ctx) };
            kv = kv.saturating_add(per_token.saturating_mul(n));
        }
        let state = crate::engine::memory::growth::checkpoint_bytes(g);
        let recurrent = if state > 0 { RECURRENT_BATCH_BYTES } else { 0 };
        kv.saturating_add(state)
            .saturating_add(recurrent + PROCESS_BASE_BYTES)
            .saturating_add(PROCESS_BYTES_PER_TOKEN.saturating_mul(self.n_vocab))
            .saturating_add(PROCESS_BYTES_PER_MERGE.saturating_mul(self.n_merges))
    }
}

/// Split GGUFs: the paths of every part, from `split.count` and the naming scheme.
fn model_files(path: &Path, first: &Gguf) -> Result<Vec<PathBuf>> {
    let n = first.get("split.count").and_then(|v| v.as_u64()).unwrap_or(1);
    if n <= 1 {
        return Ok(vec![path.to_path_buf()]);
    }
    let s = path.to_string_lossy();
    let prefix = s
        .strip_suffix(&format!("-00001-of-{n:05}.gguf"))
        .ok_or_else(|| Error::gguf(path, format!("split.count is {n}, but the name does not end in -00001-of-{n:05}.gguf")))?;
    Ok((1..=n).map(|i| PathBuf::from(format!("{prefix}-{i:05}-of-{n:05}.gguf"))).collect())
}

/// What a run would add to the model: its budget, context and projector.
#[derive(Clone, Debug, Default)]
pub struct RunPlan<'a> {
    /// `--ram-budget`: how the budget would be split.
    pub budget: Option<u64>,
    /// `--sdq-reserve` (default: the budget's default reserve).
    pub reserve: Option<u64>,
    /// The tool's `-c` (default: the model's own context).
    pub n_ctx: Option<u64>,
    /// The tool's `--mmproj`: counted in full before the arena, as a run does.
    pub mmproj: Option<&'a Path>,
    /// The tool's `-b` and `-ub` (default: 2048 and 512, the tools'): they
    /// size the compute buffers, counted in full before the arena.
    pub n_batch: Option<u32>,
    pub n_ubatch: Option<u32>,
    /// A routing trace (`--sdq-trace`) to predict the arena's decode hit
    /// rate and bytes read per token from, replayed through `policy`.
    pub trace: Option<&'a Path>,
    /// The run's eviction policy (default: the pager's).
    pub policy: Option<crate::engine::pager::PolicyKind>,
    /// The disk's read rate in MiB/s (`sdq bench-disk`): the predicted
    /// bytes per token become a read-bound decode rate.
    pub read_rate_mib_s: Option<f64>,
    /// MTP drafting (`--spec-type draft-mtp`): llama.cpp loads the NextN
    /// block, whose experts are then paged and its other weights held.
    pub mtp: bool,
    /// The tool's draft model (`-md`): its experts are paged beside the
    /// target's (numbered after them, as a run numbers them), its other
    /// weights and its context held.
    pub draft: Option<&'a Path>,
}

/// A model's files and tensors, as a run would load them.
struct ModelFiles {
    first: Gguf,
    arch: String,
    top_k: usize,
    file_bytes: u64,
    /// (file index, tensor) over every part.
    tensors: Vec<(u32, TensorInfo)>,
    paths: BTreeMap<u32, PathBuf>,
}

impl ModelFiles {
    fn open(model: &Path) -> Result<ModelFiles> {
        let first = Gguf::open(model)?;
        let files = model_files(model, &first)?;
        let arch = first.architecture().unwrap_or_default();
        let top_k = first.arch_u64("expert_used_count").unwrap_or(0) as usize;
        let mut file_bytes = 0;
        let mut tensors: Vec<(u32, TensorInfo)> = Vec::new();
        let mut paths = BTreeMap::new();
        for (idx, f) in files.iter().enumerate() {
            let g = if idx == 0 { None } else { Some(Gguf::open(f)?) };
            let g = g.as_ref().unwrap_or(&first);
            file_bytes += std::fs::metadata(f).map_err(|e| Error::io("cannot stat", f, e))?.len();
            paths.insert(idx as u32, f.clone());
            tensors.extend(g.tensors().into_iter().map(|t| (idx as u32, t)));
        }
        Ok(ModelFiles { first, arch, top_k, file_bytes, tensors, paths })
    }

    /// The weights a run with the first `n_trunk` layers loaded pages
    /// (routed experts) and holds (by category), and the bytes of the
    /// layers past them (NextN blocks), which it skips.
    fn split(&self, n_trunk: u32) -> (BTreeMap<&'static str, u64>, Vec<PagedTensor>, u64) {
        let mut resident: BTreeMap<&str, u64> = CATEGORIES.iter().map(|c| (*c, 0)).collect();
        let mut paged = Vec::new();
        let mut skipped = 0;
        for (file, t) in &self.tensors {
            // NextN (multi-token prediction) blocks follow the trunk's layers;
            // llama.cpp skips them at load unless MTP drafting is asked for.
            if layer_of(&t.name).is_some_and(|l| l >= n_trunk) {
                skipped += t.size;
                continue;
            }
            match Part::from_tensor_name(&t.name) {
                Some((layer, part)) => {
                    let row = t.ty.row_size(t.ne[0]);
                    let nb = [t.ty.row_size(t.ty.block_size()), row, row * t.ne[1] as usize, row * (t.ne[1] * t.ne[2]) as usize];
                    // Plain: a repacked expert takes as many bytes as the file's.
                    paged.push(PagedTensor {
                        name: t.name.clone(),
                        layer,
                        part,
                        ty: t.ty,
                        ne: t.ne,
                        nb,
                        file: *file,
                        offset: t.offset,
                        layout: WeightLayout::Plain,
                    });
                }
                None => *resident.get_mut(category(&t.name)).expect("category listed") += t.size,
            }
        }
        (resident, paged, skipped)
    }

    fn names(&self) -> Vec<&str> {
        self.tensors.iter().map(|(_, t)| t.name.as_str()).collect()
    }
}

/// The accounting of `model`, as JSON (the text report is rendered from it).
pub fn inspect(model: &Path, budget: Option<u64>, reserve: Option<u64>) -> Result<Value> {
    inspect_run(model, &RunPlan { budget, reserve, ..RunPlan::default() })
}

/// [`inspect`] for a run as `plan` describes it.
pub fn inspect_run(model: &Path, plan: &RunPlan) -> Result<Value> {
    let (budget, reserve, n_ctx) = (plan.budget, plan.reserve, plan.n_ctx);
    let target = ModelFiles::open(model)?;
    let (first, arch, file_bytes) = (&target.first, &target.arch, target.file_bytes);
    let mut top_k = target.top_k;
    let mut paths = target.paths.clone();

    let mut meta = ModelMeta::read(first, arch);
    if let Some(n) = n_ctx.filter(|&n| n > 0) {
        meta.n_ctx = n;
    }
    // With MTP drafting the NextN block is loaded like a trunk layer (its
    // KV cache, in the draft context, is one attention layer's too).
    let n_nextn = meta.n_blocks.saturating_sub(meta.n_trunk);
    if plan.mtp {
        meta.n_trunk = meta.n_blocks;
    }
    let (resident, mut paged, nextn_bytes) = target.split(meta.n_trunk);
    let target_pages = !paged.is_empty();
    // A draft model's experts are the pager's layers after the target's,
    // read from its own files (see runtime::LoadedModel).
    let draft = match plan.draft {
        Some(path) => {
            let d = ModelFiles::open(path)?;
            let d_meta = ModelMeta::read(&d.first, &d.arch);
            let (d_resident, d_paged, _) = d.split(d_meta.n_trunk);
            if !d_paged.is_empty() {
                crate::engine::runtime::preflight::check_expert_counts(path, &d.first)?;
            }
            let layer_base = paged.iter().map(|t| t.layer + 1).max().unwrap_or(0);
            let file_base = paths.len() as u32;
            let d_routed: u64 = d_paged.iter().map(|t| t.nb[3] as u64).sum();
            paged.extend(d_paged.into_iter().map(|mut t| {
                t.name = crate::engine::runtime::renumbered(&t.name, layer_base);
                t.layer += layer_base;
                t.file += file_base;
                t
            }));
            paths.extend(d.paths.iter().map(|(i, p)| (i + file_base, p.clone())));
            top_k = top_k.max(d.top_k);
            Some((d, d_meta, d_resident.values().sum::<u64>(), d_routed, layer_base))
        }
        None => None,
    };
    let routed: u64 = paged.iter().map(|t| t.nb[3] as u64).sum();
    let resident_total: u64 = resident.values().sum::<u64>() + draft.as_ref().map_or(0, |d| d.2);
    let mut report = json!({
        "model": model.display().to_string(),
        "architecture": arch,
        "file_bytes": file_bytes,
        "routed_expert_bytes": routed,
        "resident_bytes": resident_total,
        "resident": resident,
        "nextn_skipped_bytes": nextn_bytes,
        "nextn_blocks": n_nextn,
        "nextn_loaded": plan.mtp && n_nextn > 0,
        "top_k": top_k,
    });
    if let Some((d, _, resident, routed, layer_base)) = &draft {
        report["draft"] = json!({
            "model": plan.draft.map(|p| p.display().to_string()),
            "resident_bytes": resident,
            "routed_expert_bytes": routed,
            "first_layer": layer_base,
            "file_bytes": d.file_bytes,
        });
    }
    if paged.is_empty() {
        return Ok(report);
    }
    if target_pages {
        crate::engine::runtime::preflight::check_expert_counts(model, first)?;
    }

    // Sized as a run sizes it (direct I/O on, where the file system allows).
    let layout = Layout::build(&paged, &paths, true)?;
    let types = |l: u32, p: Part| paged.iter().find(|t| t.layer == l && t.part == p).map(|t| t.ty.name());
    let layers: Vec<Value> = layout
        .layers
        .values()
        .map(|l| {
            json!({
                "layer": l.layer,
                "experts": l.n_expert,
                "gate_up": types(l.layer, Part::GateUp).or(types(l.layer, Part::Gate)),
                "down": types(l.layer, Part::Down),
                "bytes_per_expert": l.expert_bytes,
                "class": l.class,
            })
        })
        .collect();
    let per_layer_set: Vec<u64> = layout.layers.values().map(|l| (l.expert_bytes * top_k) as u64).collect();
    let token_read: u64 = per_layer_set.iter().sum();
    // The arena counts a token cycle in slots, as the pager and replay do.
    let token_cycle = layout.token_cycle_bytes(top_k);
    let o = report.as_object_mut().expect("object");
    o.insert("layers".into(), json!(layers));
    o.insert(
        "slot_classes".into(),
        json!(layout
            .class_bytes
            .iter()
            .zip(layout.layers_per_class())
            .enumerate()
            .map(|(class, (&extent, n))| {
                let expert = layout.layers.values().find(|l| l.class == class).map_or(extent, |l| l.expert_bytes);
                // slot_bytes: with direct I/O, parts are padded to 4 KiB boundaries.
                json!({ "expert_bytes": expert, "slot_bytes": slot_bytes(extent), "layers": n })
            })
            .collect::<Vec<_>>()),
    );
    o.insert(
        "token_working_set".into(),
        json!({
            "per_layer_mean_bytes": token_read / per_layer_set.len() as u64,
            "per_layer_max_bytes": per_layer_set.iter().max(),
            "token_read_bytes": token_read,
            "token_cycle_bytes": token_cycle,
        }),
    );

    let projector = match plan.mmproj {
        Some(path) => Some(projector_memory(path)?),
        None => None,
    };
    if let Some(p) = &projector {
        o.insert(
            "projector".into(),
            json!({ "path": p.path.display().to_string(), "weights_bytes": p.weights, "compute_bytes": p.compute, "projector_type": p.kind }),
        );
    }

    if let Some(budget) = budget {
        let reserve = reserve.unwrap_or_else(|| budget::default_reserve(budget));
        // Under a budget the resident weights are read into memory (the default
        // load mode), so anonymous memory after load is all of them plus the
        // context: KV cache and recurrent state at the model's own context
        // length (the tools' default), and the process with its vocabulary.
        // With --load-mode mmap the same bytes are held as mapped weights
        // instead, less the embedding's unread rows.
        // A run counts its compute buffers as held before they are touched
        // (patch 0006); llama.cpp caps the ubatch at the batch.
        let n_batch = plan.n_batch.unwrap_or(2048);
        let n_ubatch = plan.n_ubatch.unwrap_or(512).min(n_batch);
        let mut context = meta.context_bytes(&target.names(), first);
        let mut compute = meta.compute_bytes(model, n_batch, n_ubatch);
        // The draft's context (its cache at the target's length, its state
        // and its process share) and its compute buffers.
        if let (Some((d, d_meta, ..)), Some(path)) = (&draft, plan.draft) {
            let d_meta = ModelMeta { n_ctx: meta.n_ctx, ..d_meta.clone() };
            context += d_meta.context_bytes(&d.names(), &d.first);
            compute += d_meta.compute_bytes(path, n_batch, n_ubatch);
        }
        let projector_bytes = projector.as_ref().map_or(0, |p| p.weights + p.compute);
        let anon_estimate = resident_total + context + projector_bytes;
        let held = budget::Held { anon: anon_estimate + compute, mapped: 0 };
        let budget_json = match budget::arena_bytes(budget, reserve, held, None) {
            Ok(arena) => {
                let slots = layout.plan_slots(arena, top_k).ok();
                let prediction = match (plan.trace, &slots) {
                    (Some(path), Some(_)) => Some(predict(path, &layout, top_k, arena, plan)?),
                    _ => None,
                };
                json!({
                    "prediction": prediction,
                    "budget_bytes": budget,
                    "reserve_bytes": reserve,
                    "anonymous_after_load_estimate_bytes": anon_estimate,
                    "context_estimate_bytes": context,
                    "context_length": meta.n_ctx,
                    "projector_estimate_bytes": projector_bytes,
                    "compute_buffers_bytes": compute,
                    "ubatch": n_ubatch,
                    "arena_bytes": arena,
                    "slots": slots.map(|s| s.iter().map(|&(b, n)| json!({ "expert_bytes": b, "slots": n })).collect::<Vec<_>>()),
                    "token_cycles_held": arena as f64 / token_cycle as f64,
                    "min_budget_bytes": anon_estimate + compute + reserve + layout.min_arena_bytes(top_k),
                })
            }
            Err(e) => json!({ "budget_bytes": budget, "reserve_bytes": reserve, "error": e.to_string() }),
        };
        report.as_object_mut().expect("object").insert("budget".into(), budget_json);
    }
    Ok(report)
}

/// The arena's decode hit rate and bytes per token, from the trace at `path`.
fn predict(path: &Path, layout: &Layout, top_k: usize, arena: u64, plan: &RunPlan) -> Result<Value> {
    let trace = crate::engine::routing::trace::Trace::open(path)?;
    let policy = plan.policy.unwrap_or_default();
    let p = crate::commands::replay::predict(&trace, layout, top_k, arena, policy).map_err(|e| Error::invalid(format!("--trace {}: {e}", path.display())))?;
    let mib = p.decode_bytes_per_token / MIB as f64;
    Ok(json!({
        "trace": path.display().to_string(),
        "kind": if p.same_geometry { "replay" } else { "projection" },
        "policy": policy.name(),
        "replayed_arena_bytes": p.replayed_arena_bytes,
        "decode_steps": p.decode_steps,
        "decode_held_rate": p.decode_hit_pct / 100.0,
        "decode_mib_read_per_token": mib,
        "read_rate_mib_per_second": plan.read_rate_mib_s,
        "read_bound_tokens_per_second": plan.read_rate_mib_s.filter(|_| mib > 0.0).map(|r| r / mib),
    }))
}

/// The report as text.
pub fn render(r: &Value) -> String {
    let u = |v: &Value| v.as_u64().unwrap_or(0);
    let mut s = String::new();
    let mut line = |t: String| {
        s.push_str(&t);
        s.push('\n');
    };
    line(format!("model          {} ({})", r["model"].as_str().unwrap_or(""), r["architecture"].as_str().unwrap_or("")));
    line(format!("file           {:>14} B  {}", u(&r["file_bytes"]), human(u(&r["file_bytes"]))));
    line(format!("routed experts {:>14} B  {}", u(&r["routed_expert_bytes"]), human(u(&r["routed_expert_bytes"]))));
    line(format!("resident       {:>14} B  {}", u(&r["resident_bytes"]), human(u(&r["resident_bytes"]))));
    for c in CATEGORIES {
        let b = u(&r["resident"][c]);
        if b > 0 {
            line(format!("  {c:<17}{b:>12} B  {}", human(b)));
        }
    }
    let d = &r["draft"];
    if d.is_object() {
        line(format!(
            "  of which the draft model {}: {} resident, {} of routed experts (the pager's layers from {})",
            d["model"].as_str().unwrap_or(""),
            human(u(&d["resident_bytes"])),
            human(u(&d["routed_expert_bytes"])),
            u(&d["first_layer"])
        ));
    }
    if let Some(layers) = r["layers"].as_array() {
        line(format!("\nlayer  experts  gate/up  down   bytes/expert  class   (top-{})", u(&r["top_k"])));
        for l in layers {
            line(format!(
                "{:>5}  {:>7}  {:<7}  {:<5}  {:>12}  {:>5}",
                u(&l["layer"]),
                u(&l["experts"]),
                l["gate_up"].as_str().unwrap_or("?"),
                l["down"].as_str().unwrap_or("?"),
                u(&l["bytes_per_expert"]),
                u(&l["class"])
            ));
        }
        line("\nslot classes".into());
        for (i, c) in r["slot_classes"].as_array().into_iter().flatten().enumerate() {
            line(format!("  class {i}: {} B per expert ({} per slot), {} layers", u(&c["expert_bytes"]), human(u(&c["slot_bytes"])), u(&c["layers"])));
        }
        let w = &r["token_working_set"];
        line(format!(
            "one token's experts: {} per layer on average, {} at most; {} for all layers, {} of slots in the arena (one token cycle)",
            human(u(&w["per_layer_mean_bytes"])),
            human(u(&w["per_layer_max_bytes"])),
            human(u(&w["token_read_bytes"])),
            human(u(&w["token_cycle_bytes"]))
        ));
    }
    if r["nextn_loaded"] == true {
        line(format!("NextN blocks   {:>14}    loaded for MTP drafting: their experts paged, the rest resident (counted above)", u(&r["nextn_blocks"])));
    }
    if u(&r["nextn_skipped_bytes"]) > 0 {
        line(format!(
            "NextN blocks   {:>14} B  {}  (skipped at load unless MTP drafting: neither paged nor resident)",
            u(&r["nextn_skipped_bytes"]),
            human(u(&r["nextn_skipped_bytes"]))
        ));
    }
    if let Some(p) = r.get("projector") {
        line(format!(
            "projector      {} ({}): weights {}, compute buffers {} (counted before the arena)",
            p["path"].as_str().unwrap_or(""),
            p["projector_type"].as_str().unwrap_or("?"),
            human(u(&p["weights_bytes"])),
            human(u(&p["compute_bytes"]))
        ));
    }
    if let Some(b) = r.get("budget") {
        line(format!("\nbudget {}  reserve {}", human(u(&b["budget_bytes"])), human(u(&b["reserve_bytes"]))));
        if let Some(e) = b["error"].as_str() {
            line(format!("  {e}"));
        } else {
            line(format!(
                "  anonymous memory after load (estimate: resident weights + {} of context at {} tokens{}) {}, compute buffers at -ub {} {}, arena {}, {:.1} token cycles",
                human(u(&b["context_estimate_bytes"])),
                u(&b["context_length"]),
                match u(&b["projector_estimate_bytes"]) {
                    0 => String::new(),
                    p => format!(" + {} of projector", human(p)),
                },
                human(u(&b["anonymous_after_load_estimate_bytes"])),
                u(&b["ubatch"]),
                human(u(&b["compute_buffers_bytes"])),
                human(u(&b["arena_bytes"])),
                b["token_cycles_held"].as_f64().unwrap_or(0.0)
            ));
            for s in b["slots"].as_array().into_iter().flatten() {
                line(format!("  {} slots of {}", u(&s["slots"]), human(u(&s["expert_bytes"]))));
            }
            line(format!("  smallest budget that runs (estimate): {}", human(u(&b["min_budget_bytes"]))));
            let p = &b["prediction"];
            if let Some(kind) = p["kind"].as_str() {
                let what = match kind {
                    "replay" => "the model's own routing, replayed at this arena".to_string(),
                    _ => format!(
                        "a projection: another geometry's routing, replayed at the same {:.2} token cycles and scaled",
                        b["token_cycles_held"].as_f64().unwrap_or(0.0)
                    ),
                };
                line(format!(
                    "  decode predicted from {} ({what}, {} over {} tokens): {:.1} % of lookups held (no read for the token), {:.1} MiB read per token{}",
                    p["trace"].as_str().unwrap_or(""),
                    p["policy"].as_str().unwrap_or(""),
                    u(&p["decode_steps"]),
                    100.0 * p["decode_held_rate"].as_f64().unwrap_or(0.0),
                    p["decode_mib_read_per_token"].as_f64().unwrap_or(0.0),
                    match (p["read_bound_tokens_per_second"].as_f64(), p["read_rate_mib_per_second"].as_f64()) {
                        (Some(t), Some(r)) => format!(", {t:.2} tok/s if reads alone bound it at {r:.0} MiB/s"),
                        _ => String::new(),
                    }
                ));
            }
        }
    }
    s
}
