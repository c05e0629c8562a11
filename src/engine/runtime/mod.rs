//! sdq's process-wide state while a budget is set: the options, the paged
//! tensors the loader reported, the pager (created at the first expert matmul,
//! once the model and its context are loaded, so the arena is sized from the
//! anonymous memory they really hold), and the figures for the stats file.

pub mod batching;
pub mod failure;
pub mod groups;
pub mod metrics;
pub mod options;
pub mod phases;
pub mod plan;
pub mod preflight;
pub mod pressure;
mod registry;
mod stats;

use failure::{fail_batch, fail_load, fatal};
pub use plan::ArenaPlan;
pub(crate) use registry::renumbered;

use crate::engine::ffi::ggml::{DotKernels, GgmlType, WeightLayout};
use crate::engine::memory::budget::ProcMemory;
use crate::engine::pager::layout::{Layout, PagedTensor, Part};
use crate::engine::pager::Pager;
use crate::engine::routing::hotset::{HotExpert, HotSet};
use crate::engine::routing::trace::{Phase, Recorder};
use crate::error::Error;
use crate::units::human;
use options::Options;
use phases::{ContextSize, PagerTotals, PhaseClock, PhaseTotals};
use registry::{LoadedModel, Registry};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

/// Token cycles the arena must hold for the default to prefetch.
pub const PREFETCH_MIN_CYCLES: f64 = 2.0;

/// The pager of the models loaded now: set at their first batch, taken
/// back when a host program frees the last of them. A pager, once set, is
/// never dropped (a taken one is retired and leaked), so references read
/// from the cell stay valid for the process's life.
#[derive(Default)]
struct PagerCell {
    current: std::sync::RwLock<Option<&'static (Pager, ArenaPlan)>>,
    /// The current pager, or the one retired last: the run's figures.
    latest: std::sync::RwLock<Option<&'static (Pager, ArenaPlan)>>,
}

impl PagerCell {
    fn get(&self) -> Option<&'static (Pager, ArenaPlan)> {
        *self.current.read().unwrap_or_else(|p| p.into_inner())
    }

    fn latest(&self) -> Option<&'static (Pager, ArenaPlan)> {
        *self.latest.read().unwrap_or_else(|p| p.into_inner())
    }

    /// Sets the pager unless one is set already.
    fn set(&self, made: (Pager, ArenaPlan)) {
        let mut cell = self.current.write().unwrap_or_else(|p| p.into_inner());
        if cell.is_none() {
            let made: &'static _ = Box::leak(Box::new(made));
            *cell = Some(made);
            *self.latest.write().unwrap_or_else(|p| p.into_inner()) = Some(made);
        }
    }

    fn take(&self) -> Option<&'static (Pager, ArenaPlan)> {
        self.current.write().unwrap_or_else(|p| p.into_inner()).take()
    }
}

pub struct Runtime {
    pub options: Options,
    budget: u64,
    started: Instant,
    registry: Mutex<Registry>,
    pager: PagerCell,
    /// The models loaded in full and not freed (by address).
    live_models: Mutex<std::collections::HashSet<usize>>,
    /// The totals of the pagers retired so far.
    retired_totals: Mutex<PagerTotals>,
    /// Models loaded in full so far (freed ones too).
    models_loaded: AtomicU64,
    /// Counts the pagers made: a freed model's ops are not a later one's.
    generation: AtomicU64,
    /// Each step's tokens, time and bytes read, by phase (prompt or decode).
    phases: Mutex<PhaseClock>,
    /// A prompt's ubatches computed together (one step each group).
    groups: Mutex<groups::Groups>,
    peak_rss_anon: AtomicU64,
    /// The largest compute buffers a context's generating graphs use (of
    /// what it reserved), and the process's anonymous memory then (before
    /// any of their pages were touched).
    compute_buffers: Mutex<Option<(u64, u64)>>,
    /// The largest context and ubatch of the contexts made, which bound
    /// what one prompt's ubatches can be (for the `-ub` hint).
    context_size: Mutex<ContextSize>,
    max_swap: AtomicU64,
    finished: AtomicBool,
    /// Ubatches begun (computed or failed) in every context.
    ubatches: AtomicU64,
    /// The routing being recorded (`--sdq-trace`).
    trace: Option<Mutex<Recorder>>,
    /// The hot set read at start (`--sdq-hotset`; None for a first run).
    hotset: Option<HotSet>,
    /// Experts the hot set listed for reading at start.
    warm_listed: AtomicU64,
    /// The arena's size under memory pressure (from the pager's creation).
    watch: Mutex<Option<crate::engine::runtime::pressure::Watch>>,
    /// A model with routed experts still to load (`await_model`).
    awaited: Mutex<Option<PathBuf>>,
    /// Tokens of batches computed without the pager while it waited.
    unpaged_tokens: AtomicU64,
    /// The top-k of the expert ops in a graph staged for a prompt group (0:
    /// none yet), for a pager created while the group is staged.
    staged_top_k: std::sync::atomic::AtomicUsize,
    /// Held while the pager is being created.
    creating: Mutex<()>,
}

static RUNTIME: OnceLock<Runtime> = OnceLock::new();

/// Installs the runtime for `options` (which must carry a budget) and starts
/// sampling this process's memory. Returns the installed runtime, or an
/// error if the trace file cannot be created.
pub fn install(options: Options) -> Result<&'static Runtime, Error> {
    let budget = options.budget.expect("install() needs a budget");
    crate::engine::ffi::unwind::install_panic_hook();
    let trace = options.trace_file.as_deref().map(Recorder::create).transpose()?.map(Mutex::new);
    // A malformed hot set stops the run before the model loads, and is left as it is.
    let hotset = match &options.hotset_file {
        Some(p) => HotSet::open(p)?,
        None => None,
    };
    let rt = RUNTIME.get_or_init(|| Runtime {
        options,
        budget,
        started: Instant::now(),
        registry: Mutex::new(Registry::default()),
        pager: PagerCell::default(),
        live_models: Mutex::new(Default::default()),
        retired_totals: Mutex::new(PagerTotals::default()),
        models_loaded: AtomicU64::new(0),
        generation: AtomicU64::new(0),
        phases: Mutex::new(PhaseClock::default()),
        groups: Mutex::new(groups::Groups::default()),
        peak_rss_anon: AtomicU64::new(0),
        compute_buffers: Mutex::new(None),
        context_size: Mutex::new(ContextSize::default()),
        max_swap: AtomicU64::new(0),
        finished: AtomicBool::new(false),
        ubatches: AtomicU64::new(0),
        trace,
        hotset,
        warm_listed: AtomicU64::new(0),
        watch: Mutex::new(None),
        awaited: Mutex::new(None),
        unpaged_tokens: AtomicU64::new(0),
        staged_top_k: std::sync::atomic::AtomicUsize::new(0),
        creating: Mutex::new(()),
    });
    std::thread::Builder::new()
        .name("sdq-memory".into())
        .spawn(|| {
            for tick in 1u64.. {
                if let Some(rt) = RUNTIME.get() {
                    let m = rt.sample_memory();
                    if tick % 5 == 0 {
                        rt.watch_room(m.rss_anon);
                    }
                    // A snapshot each second: a run that ends without exit
                    // handlers (Ctrl-C in llama-completion calls _exit) still
                    // leaves a stats file, at most a second old.
                    if tick % 50 == 0 && rt.pager.latest().is_some() && !rt.finished.load(Ordering::SeqCst) {
                        rt.write_stats(false);
                    }
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        })
        .expect("spawn memory sampler");
    Ok(rt)
}

/// The runtime, if a budget is set.
pub fn get() -> Option<&'static Runtime> {
    RUNTIME.get()
}

impl Runtime {
    fn lock_registry(&self) -> std::sync::MutexGuard<'_, Registry> {
        self.registry.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The loader opened file `idx` of a model: its first file starts a
    /// model (or, loaded again, as llama-bench does between tests, makes an
    /// earlier one current again).
    pub fn on_loader_file(&self, idx: u32, path: PathBuf) {
        // A tool checked its models before loading them (src/host/tools.rs); a
        // host program's load is checked here, and fails on a bad file.
        if idx == 0 && failure::embedded() {
            if let Err(e) = crate::engine::runtime::preflight::check_model(&path) {
                return fail_load(&e.to_string());
            }
        }
        let mut r = self.lock_registry();
        if idx == 0 {
            match r.models.iter().position(|m| m.path == path) {
                Some(i) => r.current = i,
                None => {
                    let layer_base = r.tensors.values().map(|t| t.layer + 1).chain(r.routers.keys().map(|l| l + 1)).max().unwrap_or(0);
                    let file_base = r.files.keys().map(|f| f + 1).max().unwrap_or(0);
                    if !r.models.is_empty() {
                        log::info!("{}: another model; its layers are the pager's from {layer_base}", path.display());
                    }
                    r.models.push(LoadedModel { path: path.clone(), loaded: false, layer_base, file_base });
                    r.current = r.models.len() - 1;
                }
            }
        }
        let file = r.loading().file_base + idx;
        r.files.insert(file, path);
    }

    /// The model loading now, `model`, has its weights in memory.
    pub fn on_model_loaded(&self, model: usize) {
        self.live_models.lock().unwrap_or_else(|p| p.into_inner()).insert(model);
        self.models_loaded.fetch_add(1, Ordering::Relaxed);
        let mut r = self.lock_registry();
        let current = r.current;
        if let Some(m) = r.models.get_mut(current) {
            m.loaded = true;
        }
    }

    /// `model` was freed. Inside a host program, once the last model sdq
    /// paged for is gone, its pager is retired (the arena's memory goes
    /// back) and what the loader reported is forgotten: the next model
    /// loaded gets an arena planned for it, within the same budget. True
    /// if so (the caller forgets the ops' state too).
    pub fn on_model_freed(&self, model: usize) -> bool {
        let last = {
            let mut live = self.live_models.lock().unwrap_or_else(|p| p.into_inner());
            live.remove(&model) && live.is_empty()
        };
        if !last || !failure::embedded() {
            return false;
        }
        let _one = self.creating.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((pager, _)) = self.pager.take() {
            let mut r = self.retired_totals.lock().unwrap_or_else(|p| p.into_inner());
            *r = *r + pager.totals();
            drop(r);
            let held = pager.retire();
            log::info!("the last model was freed: its arena ({} held) is given back", human(held));
        }
        *self.lock_registry() = Registry::default();
        *self.compute_buffers.lock().unwrap_or_else(|p| p.into_inner()) = None;
        *self.context_size.lock().unwrap_or_else(|p| p.into_inner()) = ContextSize::default();
        self.unpaged_tokens.store(0, Ordering::Relaxed);
        *self.watch.lock().unwrap_or_else(|p| p.into_inner()) = None;
        self.generation.fetch_add(1, Ordering::Relaxed);
        true
    }

    /// Which pager the ops built now belong to (see `on_model_freed`).
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Relaxed)
    }

    /// A model with routed experts that the tool will load after its first
    /// (a draft model, `-md`): the pager waits for it (see `pager_if_ready`).
    pub fn await_model(&self, path: PathBuf) {
        *self.awaited.lock().unwrap_or_else(|p| p.into_inner()) = Some(path);
    }

    /// The experts of layer `layer` are paged on RPC node `endpoint`.
    pub fn on_node_layer(&self, endpoint: &str, layer: u32) {
        let mut r = self.lock_registry();
        let e = r.on_nodes.entry(endpoint.to_string()).or_insert((layer, layer));
        *e = (e.0.min(layer), e.1.max(layer));
    }

    /// The path of file `idx` of the model loading now.
    pub fn model_file(&self, idx: u32) -> Option<PathBuf> {
        let r = self.lock_registry();
        r.files.get(&(r.loading().file_base + idx)).cloned()
    }

    /// True if this process pages experts of layer `layer`.
    pub fn pages_layer(&self, layer: u32) -> bool {
        self.lock_registry().tensors.values().any(|t| t.layer == layer)
    }

    /// The pager's layer of the paged weight at `tensor` (the loader's
    /// tensor), if the loader reported it.
    pub fn paged_layer_of(&self, tensor: usize) -> Option<u32> {
        self.lock_registry().weights.get(&tensor).copied()
    }

    /// True if the weight `name` of type `ty` is a routed expert to page. A
    /// routed expert of a type ggml's CPU backend cannot multiply is an error.
    /// `layout` is the one stock would give it: sdq's reads and kernels
    /// reproduce it; `notice` (said once) where they cannot.
    pub fn is_paged(&self, name: &str, ty: GgmlType, layout: WeightLayout, notice: Option<String>) -> Result<bool, Error> {
        if Part::from_tensor_name(name).is_none() {
            return Ok(false);
        }
        if DotKernels::for_type(ty).is_none() {
            return Err(Error::model(format!("tensor {name} has type {}, which ggml's CPU backend cannot multiply; sdq cannot page it", ty.name())));
        }
        let mut r = self.lock_registry();
        let name = renumbered(name, r.loading().layer_base);
        if let Some(n) = notice {
            if r.layout_notices.insert(n.clone()) {
                stderr_line!("sdq: notice: {name}: {n}");
            }
        }
        log::debug!("{name}: {} layout", layout.name());
        r.layouts.insert(name, layout);
        Ok(true)
    }

    /// The layout stock gives paged weight `name` (plain if it was not paged).
    pub fn weight_layout(&self, name: &str) -> WeightLayout {
        self.lock_registry().layouts.get(name).copied().unwrap_or(WeightLayout::Plain)
    }

    pub fn on_mapped_weight(&self, name: String, bytes: u64) {
        self.lock_registry().mapped.push((name, bytes));
    }

    /// A weight the loader keeps resident; routers are remembered.
    pub fn on_resident_weight(&self, name: &str, tensor: usize) {
        let layer = name.strip_prefix("blk.").and_then(|r| r.strip_suffix(".ffn_gate_inp.weight")).and_then(|n| n.parse::<u32>().ok());
        if let Some(layer) = layer {
            let mut r = self.lock_registry();
            let base = r.loading().layer_base;
            r.routers.insert(layer + base, tensor);
        }
    }

    /// Whether to read the next layer's predicted experts ahead: always or
    /// never where `SDQ_PREFETCH` says, and by default only while the arena
    /// holds at least [`PREFETCH_MIN_CYCLES`] token cycles and most
    /// predicted experts are used ([`crate::engine::pager::gate`]). Below two
    /// cycles a prediction that misses evicts an expert this token or the
    /// next one needs: on DeepSeek-V3 at 0.55 and 1.64 cycles, prefetching
    /// read 44 % and 54 % more bytes a token for no speed; on routing that
    /// looks trained, a quarter of the predictions miss, and on gpt-oss-120b
    /// at 2.9 and 5 cycles prefetching read a third more for the same speed
    /// (docs/BENCHMARKS.md).
    pub fn prefetch_worthwhile(&self, pager: &Pager, top_k: usize) -> bool {
        self.options.prefetch.unwrap_or_else(|| pager.token_cycles(top_k) >= PREFETCH_MIN_CYCLES && pager.prefetch_pays())
    }

    /// The next layer after `layer` with paged experts, and its router, if
    /// prefetching is on and the loader reported one. Once the pager exists
    /// and its arena has a slot for every expert, there is nothing to evict
    /// and so nothing to predict: graphs built from then on skip it (the
    /// prediction reads the next layer's router a second time per token).
    pub fn next_router(&self, layer: u32) -> Option<(u32, usize)> {
        if !self.options.prefetch.unwrap_or(true) || self.pager.get().is_some_and(|(p, _)| p.holds_every_expert()) {
            return None;
        }
        let r = self.lock_registry();
        // Within the model: a draft's first layer follows no layer of the target.
        let model = r.model_layers(layer);
        let next = r.tensors.values().map(|t| t.layer).filter(|&l| l > layer && model.contains(&l)).min()?;
        r.routers.get(&next).map(|&t| (next, t))
    }

    /// The loader placed paged weight `t` (numbered in its own model) at
    /// address `tensor`.
    pub fn on_paged_weight(&self, mut t: PagedTensor, tensor: usize) {
        let mut r = self.lock_registry();
        let model = r.loading();
        t.name = renumbered(&t.name, model.layer_base);
        t.layer += model.layer_base;
        t.file += model.file_base;
        r.weights.insert(tensor, t.layer);
        t.layout = r.layouts.get(&t.name).copied().unwrap_or(WeightLayout::Plain);
        if let Some((pager, _)) = self.pager.get() {
            let Some(span) = pager.layout().layers.get(&t.layer).and_then(|l| l.part(t.part)) else {
                // The arena was planned for the experts loaded before the
                // first batch; reloading one of those models is fine.
                let first = r.models.first().map(|m| m.path.clone()).unwrap_or_default();
                return fail_load(&format!(
                    "{}: a model with routed experts loaded after the first batch ran (the first model is {}); under --ram-budget sdq pages the experts of the models a process loads before it computes (a target and its draft model, -md), so models loaded in turn (llama-bench -m A -m B, or a program that loads another model after using one) need one process each",
                    model.path.display(),
                    first.display()
                ));
            };
            // The arena holds experts in the layout of the first load; a later
            // load (llama-bench's next test) must want the same one.
            if span.layout != t.layout {
                return fail_load(&format!(
                    "{}: the arena holds this process's experts in the {} layout, and this model load wants {} (another --repack setting); under --ram-budget, run one repack setting per process",
                    t.name,
                    span.layout.name(),
                    t.layout.name()
                ));
            }
        }
        r.tensors.insert(t.name.clone(), t);
    }

    /// The lowest layer with paged experts (the registry is complete once
    /// graphs are being built).
    pub fn first_paged_layer(&self) -> u32 {
        self.paged_layers().0
    }

    /// The lowest and the highest layer with paged experts of the first
    /// model (the target: a step is one of its batches; a draft model's
    /// layers compute inside the target's steps).
    pub fn paged_layers(&self) -> (u32, u32) {
        let r = self.lock_registry();
        let first = r.model_layers(0);
        let layers = || r.tensors.values().map(|t| t.layer).filter(|l| first.contains(l));
        (layers().min().unwrap_or(0), layers().max().unwrap_or(0))
    }

    /// A context reserved `bytes` of compute buffers in host memory, within
    /// `one_output` of which a full ubatch asking one output per sequence
    /// places its tensors. A generating tool asks for the last token's
    /// logits only, so the planner counts `one_output`; the rest (every
    /// token's logits, which llama-perplexity asks for) is left to the
    /// reserve, which such a tool needs to match. The context is of `size`.
    pub fn on_compute_buffers(&self, bytes: u64, one_output: u64, size: ContextSize) {
        self.context_size.lock().unwrap_or_else(|p| p.into_inner()).widen(size);
        let rss = ProcMemory::read().rss_anon;
        log::debug!(
            "a context of {} tokens (ubatch {}) reserved {} of compute buffers, {} of them for a ubatch of one output; the process holds {}",
            size.n_ctx,
            size.n_ubatch,
            human(bytes),
            human(one_output),
            human(rss)
        );
        let mut c = self.compute_buffers.lock().unwrap_or_else(|p| p.into_inner());
        // The latest of the largest: common's parameter fitting reserves a
        // context of the same size before the weights are read.
        if c.map_or(true, |(b, _)| one_output >= b) {
            *c = Some((one_output, rss));
        }
        drop(c);
        // A tool says a budget too small at its first batch (today's line);
        // a host program hears it as the context's creation failing.
        if failure::embedded() {
            if let Err(e) = self.check_budget_for_context() {
                fail_load(&e.to_string());
            }
        }
    }

    /// Of the compute buffers, what the process does not hold yet with
    /// `rss` of anonymous memory: ggml allocates them untouched, and the
    /// first graph touches only part of them before the arena is planned.
    /// (What grew since they were reserved is taken as theirs.)
    fn untouched_compute(&self, rss: u64) -> u64 {
        let c = *self.compute_buffers.lock().unwrap_or_else(|p| p.into_inner());
        c.map_or(0, |(bytes, at)| bytes.saturating_sub(rss.saturating_sub(at)))
    }

    /// The pager, or None while a model with routed experts the tool will
    /// load (`await_model`) has not loaded: the arena is planned once for
    /// every model's experts, after all of them and their contexts hold
    /// their memory. Only the target's warm-up runs before its draft model
    /// loads (`common_init_from_params` decodes BOS and EOS, then clears the
    /// context and drops the result), so a batch of `n_tokens` is let
    /// through without experts only while such batches add up to at most
    /// the warm-up's two tokens; anything more is an error, not a wrong
    /// answer. None also when the pager cannot be created (a budget too
    /// small) inside a host program: the batch fails (see `embed`).
    pub fn pager_if_ready(&self, top_k: usize, n_tokens: Option<u64>) -> Option<&Pager> {
        if self.pager.get().is_none() {
            let awaited = self.awaited.lock().unwrap_or_else(|p| p.into_inner()).clone();
            if let Some(path) = awaited.filter(|p| !self.lock_registry().models.iter().any(|m| m.path == *p && m.loaded)) {
                let n = n_tokens.map_or(0, |n| self.unpaged_tokens.fetch_add(n, Ordering::Relaxed) + n);
                if n > 2 {
                    fatal(&format!(
                        "{}: the draft model has not loaded and the target has computed {n} tokens without it; the arena is planned once both are loaded, so only the target's warm-up may run before (a tool that decodes first is not supported)",
                        path.display()
                    ));
                }
                log::debug!("a batch before the draft model {} loaded (the warm-up): its routed experts are left out", path.display());
                return None;
            }
        }
        // A host's batch already abandoned (its pager could not be created
        // at an earlier layer or by another thread): the rest of it is left
        // out, not planned again.
        if self.pager.get().is_none() && failure::fails_batches() && failure::batch_abandoned() {
            return None;
        }
        match self.try_pager(top_k) {
            Ok(p) => Some(p),
            // Inside a host program the batch fails (llama_decode returns
            // non-zero), its experts left out, and so does a host's batch on
            // an rpc-server node; a tool ends with the error.
            Err(e) if failure::fails_batches() => {
                fail_batch(&e.to_string());
                None
            }
            Err(e) => fatal(&e.to_string()),
        }
    }

    /// The pager, if it has been created (nothing is planned here).
    pub fn pager_ready(&self) -> Option<&Pager> {
        self.pager.get().map(|(p, _)| p)
    }

    /// The pager, created on first use from what the loader reported.
    pub fn pager(&self, top_k: usize) -> &Pager {
        self.try_pager(top_k).unwrap_or_else(|e| fatal(&e.to_string()))
    }

    /// The pager, created on first use; an error (a budget too small) is
    /// returned, and the next batch tries again.
    fn try_pager(&self, top_k: usize) -> Result<&Pager, Error> {
        if let Some((p, _)) = self.pager.get() {
            return Ok(p);
        }
        let _one = self.creating.lock().unwrap_or_else(|p| p.into_inner());
        if self.pager.get().is_none() {
            let made = self.create_pager(top_k)?;
            self.pager.set(made);
        }
        Ok(&self.pager.get().expect("the pager was just set").0)
    }

    /// True if the routing is being recorded.
    pub fn tracing(&self) -> bool {
        self.trace.is_some()
    }

    /// Records one paged layer's routing of one batch to the trace:
    /// `rows` are (expert, router weight) in token order, `top_k` per token;
    /// `first` for the first paged layer, which starts a step.
    pub fn record_routing(&self, layer: u32, first: bool, n_tokens: usize, top_k: usize, rows: impl IntoIterator<Item = (u32, f32)>) {
        let Some(trace) = &self.trace else { return };
        // The comment lines need the layout, which the pager builds.
        let layout = self.pager(top_k).layout();
        let mut t = trace.lock().unwrap_or_else(|p| p.into_inner());
        let result = t
            .start(top_k, layout.layers.values().map(|l| (l.layer, l.expert_bytes as u64, l.n_expert, l.slot_extent as u64)))
            .and_then(|()| t.record(first, Phase::of_tokens(n_tokens), layer, rows));
        if let Err(e) = result {
            drop(t);
            fatal(&e.to_string());
        }
    }

    /// Saves the hot set (if asked for): the arena's experts and the
    /// policy's counts. A failure is a warning: the run's output matters more.
    fn save_hotset(&self) {
        let (Some(path), Some((pager, _))) = (&self.options.hotset_file, self.pager.latest()) else { return };
        let (counts, held) = pager.hot_set();
        let mut experts: std::collections::BTreeMap<crate::engine::pager::ExpertKey, HotExpert> =
            counts.into_iter().map(|(key, count)| (key, HotExpert { key, count, held: false })).collect();
        for key in held {
            experts.entry(key).or_insert(HotExpert { key, count: 0.0, held: true }).held = true;
        }
        let set = HotSet { layers: geometry(pager.layout()), experts: experts.into_values().collect() };
        match set.save(path) {
            Ok(()) => log::info!("hot set of {} experts saved to {}", set.experts.iter().filter(|e| e.held).count(), path.display()),
            Err(e) => stderr_line!("sdq: warning: {e}"),
        }
    }

    /// How many of a decode's `n_ubatches` ubatches to compute together,
    /// layer by layer (1: one at a time): all of them, up to `SDQ_GROUP`,
    /// whatever the arena holds. An arena smaller than a layer's experts
    /// still holds what a group touches at a layer where routing is
    /// trained (DeepSeek-V3 cut to 19 layers at 8 GiB: 192 slots, about 132
    /// of a layer's 256 experts touched by a 2,115-token prompt). What the
    /// group stages is held within its allowance of the reserve, its first
    /// ubatch too (`group_room`), so however tight the budget the group
    /// fits or the batch keeps stock's order.
    pub fn group_size(&self, n_ubatches: u32) -> u32 {
        let cap = self.options.group.unwrap_or(u32::MAX);
        // A trace's steps are ubatches, each layer after layer (the replay
        // reproduces the run's decisions from that order).
        if self.tracing() {
            return 1;
        }
        n_ubatches.min(cap)
    }

    /// The next `ubatches` ubatches (`tokens` tokens) are computed
    /// together; they hold `bytes` staged, and `op_out` is their expert
    /// ops' largest output.
    pub fn on_group_begins(&self, ubatches: u32, tokens: u64, bytes: u64, op_out: u64) {
        self.lock_groups().begin(ubatches, tokens, bytes, op_out);
    }

    /// Whether a group whose `n_staged` ubatches hold `bytes` may stage
    /// another. A group's staged ubatches are memory the arena plan does not
    /// hold: they take at most half of what the tool's planned growth
    /// (llama-server's prompt cache and checkpoints, three quarters of the
    /// reserve by default; see `memory::growth`) leaves of the reserve, the
    /// other half staying for the rest of the growth after load. Where that
    /// is short, an arena that holds every expert of a layer and half as many
    /// again (but not every expert of the model) lends the rest for the
    /// group (`pressure::Watch::lend`): its ubatches still find a layer's
    /// experts, and the batch is read once rather than once per group.
    ///
    /// An arena smaller than a layer's experts cannot keep them for the
    /// group's later ubatches: there the group shares its expert ops (see
    /// `groups`), which needs only a few slots, so the arena lends all but
    /// two layers' top-k. `op_out` is what each later ubatch then keeps.
    pub fn group_room(&self, n_staged: u32, bytes: u64, op_out: u64) -> bool {
        let reserve = match self.pager.get() {
            Some((_, plan)) => plan.reserve,
            None => self.options.reserve.unwrap_or_else(|| crate::engine::memory::budget::default_reserve(self.budget)),
        };
        let allowance = reserve.saturating_sub(self.options.planned_growth) / 2;
        // A process's first prompt is staged before any expert op has asked
        // for the pager: it is made now, for the arena to lend from.
        let top_k = self.staged_top_k.load(Ordering::Relaxed);
        if self.pager.get().is_none() && top_k > 0 {
            let _ = self.pager_if_ready(top_k, None);
        }
        let room = self.with_watch(|watch, pager, plan| {
            let mut groups = self.lock_groups();
            if n_staged == 0 {
                groups.stage(self.shares_expert_ops(pager));
                // What a group stages and keeps goes back to the system when
                // it ends, before the arena fills again what it lent.
                crate::engine::memory::budget::return_large_frees();
            }
            // An arena of every expert reads nothing again however the
            // batch is cut: it keeps its experts rather than lend.
            let floor = if groups.staging_shares() { pager.layout().min_arena_bytes(plan.top_k) * 2 } else { pager.layout().largest_layer_bytes() * 3 / 2 };
            let lendable = if pager.holds_every_expert() { 0 } else { watch.lendable(floor) };
            if !groups.room(n_staged, bytes, op_out, allowance + lendable) {
                return false;
            }
            let more = groups.staging_needs(n_staged, bytes, op_out).saturating_sub(allowance + watch.lent());
            if more > 0 {
                watch.lend(more, pager, plan.top_k);
                groups.lent(watch.lent());
            }
            true
        });
        room.unwrap_or_else(|| self.lock_groups().room(n_staged, bytes, op_out, allowance))
    }

    /// Whether a prompt group's ubatches share their expert ops: where its
    /// layers' experts are one op (`moe::shares_expert_ops`) and the arena
    /// holds fewer than a layer's experts (`SDQ_GROUP_SHARE` decides
    /// instead where set).
    fn shares_expert_ops(&self, pager: &Pager) -> bool {
        crate::engine::moe::fused_layers_built() && self.options.group_share.unwrap_or_else(|| !pager.holds_a_layer())
    }

    /// Whether the group being computed shares its expert ops.
    pub fn group_shares(&self) -> bool {
        self.lock_groups().shares()
    }

    /// A first ubatch's op computed a layer's experts for its whole group.
    pub fn on_layer_shared(&self) {
        self.lock_groups().layer_shared();
    }

    /// A graph staged for a prompt group computes experts `top_k` at a time.
    pub fn staged_top_k(&self, top_k: usize) {
        self.staged_top_k.store(top_k, Ordering::Relaxed);
    }

    /// The group is computed, or failed.
    pub fn on_group_ends(&self) {
        self.lock_groups().end();
        self.with_watch(|watch, pager, plan| watch.give_back(pager, plan.top_k));
        if let Some((pager, _)) = self.pager.get() {
            pager.group_ends();
        }
    }

    /// Groups computed so far, the ubatches in them, the most a group's
    /// staged ubatches held, and the batches that found no room for one.
    pub fn groups_computed(&self) -> groups::GroupCounts {
        self.lock_groups().counts()
    }

    /// A ubatch of `n_tokens` reaches the first paged layer: the tokens its
    /// step counts, or None inside a group's step (see `groups`).
    pub fn step_starts(&self, n_tokens: u64) -> Option<u64> {
        self.lock_groups().step_starts(n_tokens)
    }

    /// A ubatch leaves the last paged layer: true if its step ends there.
    pub fn step_ends(&self) -> bool {
        self.lock_groups().step_ends()
    }

    fn lock_groups(&self) -> std::sync::MutexGuard<'_, groups::Groups> {
        self.groups.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A decode's next ubatch starts at position `pos0` of its sequence.
    pub fn on_ubatch(&self, pos0: i32) {
        self.ubatches.fetch_add(1, Ordering::Relaxed);
        self.lock_phases().ubatch_begins(pos0);
    }

    /// Counts the tokens of one batch (called once per batch, at its first
    /// paged layer), which starts that step's clock.
    pub fn count_tokens(&self, n: u64) {
        let totals = self.pager_totals();
        let ended = self.lock_phases().step_started(n, totals, Instant::now());
        if let Some(run) = ended {
            self.hint_ubatch(&run);
        }
    }

    /// A prompt step's layer `layer` uses `experts` (for the `-ub` hint).
    pub fn prompt_touched(&self, layer: u32, experts: &[u32]) {
        let Some((pager, _)) = self.pager.get() else { return };
        let Some(l) = pager.layout().layers.get(&layer) else { return };
        self.lock_phases().touched(layer, experts, l.expert_bytes as u64);
    }

    /// Says once, in one line, when a prompt read its experts several times
    /// over (once per ubatch) and a larger `-ub` whose compute buffers fit
    /// the budget's headroom would read fewer. The user's flags stay as given.
    fn hint_ubatch(&self, run: &crate::engine::runtime::phases::PromptRun) {
        static SAID: AtomicBool = AtomicBool::new(false);
        let Some((pager, plan)) = self.pager.get() else { return };
        // An arena of every expert evicts none: what the prompt read beyond
        // what it touched is the preload, which no -ub changes.
        if pager.holds_every_expert() {
            return;
        }
        let now = self.sample_memory().rss_anon;
        let peak = self.peak_rss_anon.load(Ordering::Relaxed).max(now);
        // Compute buffers at this ubatch: what its context reserved (every
        // context reports them before its first graph).
        let compute = self.compute_buffers.lock().unwrap_or_else(|p| p.into_inner()).map_or(0, |c| c.0);
        // The larger buffers must fit beside this run's peak, and a run
        // started with them must still pass the load-time minimum (after
        // load, the reserve and one layer's top-k).
        let minimum = plan.rss_anon_at_start + plan.compute_untouched + plan.mapped_weight_bytes + plan.reserve + pager.layout().min_arena_bytes(plan.top_k);
        let headroom = self.budget.saturating_sub(peak).min(self.budget.saturating_sub(minimum));
        log::debug!(
            "prompt of {} tokens in {} steps of {}: read {}, touched {}; compute {}, headroom {}",
            run.tokens,
            run.steps,
            run.ubatch,
            human(run.bytes_read),
            human(run.touched_bytes),
            human(compute),
            human(headroom)
        );
        let size = *self.context_size.lock().unwrap_or_else(|p| p.into_inner());
        // Where a batch's ubatches are computed together, a prompt's steps
        // are its llama_decode batches and -ub changes nothing; one batch
        // of the whole prompt reads each expert once where the arena holds
        // a layer's experts, or what a group touched at a layer (its
        // batches were grouped). Where a group found no room, its batch went
        // one ubatch at a time.
        let groups = self.groups_computed();
        if self.options.group.map_or(true, |n| n > 1) && !self.tracing() && groups.refused == 0 {
            let Some(batch) = run.batch_hint(size, groups.capacity).filter(|_| pager.holds_a_layer() || groups.computed > 0) else { return };
            if !SAID.swap(true, Ordering::Relaxed) {
                // A group's room may hold fewer ubatches than the prompt's:
                // then each group of the batch reads its experts again.
                let batches = run.tokens.div_ceil(batch);
                let reads = if batches > 1 { format!("{batches} times (a group holds {} ubatches at this budget)", groups.capacity) } else { "once".into() };
                stderr_line!(
                    "sdq: hint: {} (each llama_decode batch reads its experts again); -b {batch} would read them about {reads}",
                    run.what_it_read("batches of up to")
                );
            }
            return;
        }
        let Some(h) = run.ubatch_hint(compute, headroom, size) else { return };
        if SAID.swap(true, Ordering::Relaxed) {
            return;
        }
        stderr_line!(
            "sdq: hint: {} (each ubatch reads its experts again); -ub {} (with -b at least that) would read about {}, and its compute buffers (about {} more) fit the budget",
            run.what_it_read("ubatches of"),
            h.ubatch,
            human(h.reads),
            human(h.extra)
        );
    }

    /// The pagers' totals: every retired pager's and the current one's.
    fn pager_totals(&self) -> PagerTotals {
        let retired = *self.retired_totals.lock().unwrap_or_else(|p| p.into_inner());
        retired + self.pager.get().map_or_else(Default::default, |(p, _)| p.totals())
    }

    /// The prompt's and the decode's totals so far, the open step included.
    fn phase_totals(&self) -> (PhaseTotals, PhaseTotals) {
        let totals = self.pager_totals();
        self.lock_phases().totals(totals, Instant::now())
    }

    /// The batch's last paged layer is computed.
    pub fn step_ended(&self) {
        self.lock_phases().step_ended(Instant::now());
    }

    fn lock_phases(&self) -> std::sync::MutexGuard<'_, PhaseClock> {
        self.phases.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Fits the arena to the room the process has now (see `pressure`),
    /// once the pager exists; `rss_anon` is this tick's sample.
    fn watch_room(&self, rss_anon: u64) {
        self.with_watch(|w, pager, plan| w.poll(pager, plan.top_k, rss_anon));
    }

    /// Runs `f` on the arena's watch (made on first use), once the pager
    /// exists.
    fn with_watch<R>(&self, f: impl FnOnce(&mut crate::engine::runtime::pressure::Watch, &Pager, &ArenaPlan) -> R) -> Option<R> {
        let (pager, plan) = self.pager.get()?;
        let mut watch = self.watch.lock().unwrap_or_else(|p| p.into_inner());
        let w = watch.get_or_insert_with(|| {
            let bounds =
                crate::engine::runtime::pressure::Plan { budget: self.budget, arena: plan.arena_bytes, min_arena: pager.layout().min_arena_bytes(plan.top_k) };
            crate::engine::runtime::pressure::Watch::new(bounds, self.options.budget_auto)
        });
        Some(f(w, pager, plan))
    }

    fn sample_memory(&self) -> ProcMemory {
        let m = ProcMemory::read();
        self.peak_rss_anon.fetch_max(m.rss_anon, Ordering::Relaxed);
        self.max_swap.fetch_max(m.vm_swap, Ordering::Relaxed);
        m
    }
}

/// A layout's geometry as hot sets record it: layer → (bytes per expert, experts).
fn geometry(layout: &Layout) -> BTreeMap<u32, (u64, u32)> {
    layout.layers.values().map(|l| (l.layer, (l.expert_bytes as u64, l.n_expert))).collect()
}

#[cfg(test)]
mod tests {
    use super::renumbered;

    #[test]
    fn a_later_models_layers_follow_the_first_models() {
        assert_eq!(renumbered("blk.3.ffn_up_exps.weight", 8), "blk.11.ffn_up_exps.weight");
        assert_eq!(renumbered("blk.3.ffn_up_exps.weight", 0), "blk.3.ffn_up_exps.weight");
        assert_eq!(renumbered("token_embd.weight", 8), "token_embd.weight");
        assert_eq!(renumbered("blk.x.ffn_up_exps.weight", 8), "blk.x.ffn_up_exps.weight");
    }
}
