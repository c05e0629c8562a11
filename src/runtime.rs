//! sdq's process-wide state while a budget is set: the options, the paged
//! tensors the loader reported, the pager (created at the first expert matmul,
//! once the model and its context are loaded, so the arena is sized from the
//! anonymous memory they really hold), and the figures for the stats file.

use crate::budget::{self, human, ProcMemory};
use crate::error::Error;
use crate::ggml::{DotKernels, GgmlType, WeightLayout};
use crate::options::Options;
use crate::pager::io::ExpertReader;
use crate::pager::layout::{Layout, Part, PagedTensor};
use crate::pager::Pager;
use crate::phases::{PagerTotals, PhaseClock, PhaseTotals};
use crate::hotset::{HotExpert, HotSet};
use crate::trace::{Phase, Recorder};
use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

/// How the pager was sized.
#[derive(Clone, Debug)]
pub struct ArenaPlan {
    pub reserve: u64,
    pub rss_anon_at_start: u64,
    /// Compute buffers reserved and not yet touched then, counted as held.
    pub compute_untouched: u64,
    /// Weights in the file mapping that every token reads (see `budget::Held`).
    pub mapped_weight_bytes: u64,
    pub arena_bytes: u64,
    /// (expert bytes, slots) per class.
    pub slots: Vec<(usize, usize)>,
    pub top_k: usize,
    pub load_seconds: f64,
    /// The tool's projector (`--mmproj`), counted before the arena.
    pub projector: Option<crate::inspect::Projector>,
}

#[derive(Default)]
struct Registry {
    files: BTreeMap<u32, PathBuf>,
    tensors: BTreeMap<String, PagedTensor>,
    /// Weights the loader left in the file mapping: (name, bytes).
    mapped: Vec<(String, u64)>,
    /// Each layer's router (`blk.N.ffn_gate_inp.weight`), for predicting the
    /// next layer's experts: the loader's tensor, as an address.
    routers: BTreeMap<u32, usize>,
    /// The layout stock gives each paged weight (plain or repacked), by name.
    layouts: BTreeMap<String, WeightLayout>,
    /// Notices about layouts already printed.
    layout_notices: BTreeSet<String>,
    /// The models the loader opened, in load order, and the one loading now.
    models: Vec<LoadedModel>,
    current: usize,
    /// Each paged weight's layer as the pager numbers it, by the address of
    /// the loader's tensor (the graph's expert ops see that tensor).
    weights: std::collections::HashMap<usize, u32>,
}

/// A model the process loaded (a draft model, `-md`, beside the target).
/// The pager knows experts by layer and reads by file index, so each model's
/// layers and files are numbered after those of the models loaded before it:
/// a draft's `blk.0` is the pager's layer `layer_base`. The first model's
/// numbers are its own.
#[derive(Clone, Debug)]
struct LoadedModel {
    /// Its first file, as the tool named it.
    path: PathBuf,
    /// Its weights are in memory (not only a dry run's metadata).
    loaded: bool,
    layer_base: u32,
    file_base: u32,
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
    fn loading(&self) -> LoadedModel {
        self.models.get(self.current).cloned().unwrap_or(LoadedModel { path: PathBuf::new(), loaded: false, layer_base: 0, file_base: 0 })
    }

    /// The pager's layers of the model that holds pager layer `layer`.
    fn model_layers(&self, layer: u32) -> std::ops::Range<u32> {
        let base = self.models.iter().map(|m| m.layer_base).filter(|&b| b <= layer).max().unwrap_or(0);
        let end = self.models.iter().map(|m| m.layer_base).filter(|&b| b > base).min().unwrap_or(u32::MAX);
        base..end
    }

    /// Bytes of mapped weights each token reads: all but one `token_embd.weight`,
    /// the input embedding, which `get_rows` reads a row per token. (A model
    /// with tied embeddings maps it twice, once as the output: that one counts.)
    fn mapped_hot_bytes(&self) -> u64 {
        let total: u64 = self.mapped.iter().map(|(_, b)| b).sum();
        let embd = self.mapped.iter().find(|(n, _)| n == "token_embd.weight").map_or(0, |(_, b)| *b);
        total - embd
    }
}

/// Token cycles the arena must hold for the default to prefetch.
pub const PREFETCH_MIN_CYCLES: f64 = 2.0;

pub struct Runtime {
    pub options: Options,
    budget: u64,
    started: Instant,
    registry: Mutex<Registry>,
    pager: OnceLock<(Pager, ArenaPlan)>,
    /// Each step's tokens, time and bytes read, by phase (prompt or decode).
    phases: Mutex<PhaseClock>,
    peak_rss_anon: AtomicU64,
    /// The largest compute buffers a context reserved, and the process's
    /// anonymous memory then (before any of their pages were touched).
    compute_buffers: Mutex<Option<(u64, u64)>>,
    max_swap: AtomicU64,
    finished: AtomicBool,
    /// The routing being recorded (`--sdq-trace`).
    trace: Option<Mutex<Recorder>>,
    /// The hot set read at start (`--sdq-hotset`; None for a first run).
    hotset: Option<HotSet>,
    /// Experts the hot set listed for reading at start.
    warm_listed: AtomicU64,
    /// The arena's size under memory pressure (from the pager's creation).
    watch: Mutex<Option<crate::pressure::Watch>>,
    /// A model with routed experts still to load (`await_model`).
    awaited: Mutex<Option<PathBuf>>,
    /// Tokens of batches computed without the pager while it waited.
    unpaged_tokens: AtomicU64,
    /// Held while the pager is being created.
    creating: Mutex<()>,
}

static RUNTIME: OnceLock<Runtime> = OnceLock::new();

/// Installs the runtime for `options` (which must carry a budget) and starts
/// sampling this process's memory. Returns the installed runtime, or an
/// error if the trace file cannot be created.
pub fn install(options: Options) -> Result<&'static Runtime, Error> {
    let budget = options.budget.expect("install() needs a budget");
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
        pager: OnceLock::new(),
        phases: Mutex::new(PhaseClock::default()),
        peak_rss_anon: AtomicU64::new(0),
        compute_buffers: Mutex::new(None),
        max_swap: AtomicU64::new(0),
        finished: AtomicBool::new(false),
        trace,
        hotset,
        warm_listed: AtomicU64::new(0),
        watch: Mutex::new(None),
        awaited: Mutex::new(None),
        unpaged_tokens: AtomicU64::new(0),
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
                    if tick % 50 == 0 && rt.pager.get().is_some() && !rt.finished.load(Ordering::SeqCst) {
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

/// Ends the process at once with `msg` on stderr (and the stats file, if
/// asked for). For errors inside ggml's callbacks, where nothing can be
/// returned: no token is produced after this.
pub fn fatal(msg: &str) -> ! {
    eprintln!("sdq: error: {msg}");
    if let Some(rt) = get() {
        rt.finish(false);
    }
    // SAFETY: _exit ends the process without running atexit handlers or
    // destructors, which other threads (ggml's workers) may still be using.
    unsafe { libc::_exit(1) }
}

/// A batch abandoned because an expert read failed. llama-server goes on
/// without the batch: every context asks sdq's abort callback after each
/// node (patch 0011), and the server answers the batch's requests with the
/// error. A host program of sdq's libllama sees llama_decode fail. Every
/// other tool ends on a failed read (llama-cli shares the server's code, and
/// the callback, but is told not to go on).
struct BatchAbort {
    /// The tool abandons a batch rather than end (`allow_batch_abort`).
    supported: AtomicBool,
    /// `IDLE`, `REQUESTED` (ggml has yet to be told to stop the graph) or
    /// `STOPPING` (told: the graph ends at this node; failures of its other
    /// threads in the same node are the same batch's).
    state: AtomicU8,
    /// The first error of the abandoned batch, until the tool takes it.
    error: Mutex<Option<String>>,
}

const IDLE: u8 = 0;
const REQUESTED: u8 = 1;
const STOPPING: u8 = 2;

static BATCH_ABORT: BatchAbort = BatchAbort { supported: AtomicBool::new(false), state: AtomicU8::new(IDLE), error: Mutex::new(None) };

/// An expert the batch needs could not be read: the batch is abandoned where
/// the tool can do that (its outputs are never used: ggml stops the graph
/// after the current node and the tool drops the batch), else the process
/// ends with the error.
pub fn fail_batch(msg: &str) {
    if !BATCH_ABORT.supported.load(Ordering::Acquire) {
        fatal(msg);
    }
    let mut first = BATCH_ABORT.error.lock().unwrap_or_else(|p| p.into_inner());
    // Said once per abandoned batch (its other threads may fail too, also
    // after ggml was told to stop, while they finish the node).
    if BATCH_ABORT.state.compare_exchange(IDLE, REQUESTED, Ordering::AcqRel, Ordering::Acquire).is_ok() {
        say_error(&format!("sdq: error: {msg}; the batch is abandoned"));
    }
    if first.is_none() {
        *first = Some(msg.to_string());
    }
}

/// sdq runs inside a host program (src/library.rs): what would end a tool
/// fails the batch instead (llama_decode returns non-zero), and the host
/// goes on.
static EMBEDDED: AtomicBool = AtomicBool::new(false);

/// The error that fails the model load in progress (inside a host program).
static LOAD_ERROR: Mutex<Option<String>> = Mutex::new(None);

/// A file or weight sdq cannot page: inside a host program the model load
/// fails (the loader throws the error: llama_model_load_from_file returns
/// NULL) and the program goes on; a tool ends with the error.
pub fn fail_load(msg: &str) {
    if !EMBEDDED.load(Ordering::Acquire) {
        fatal(msg);
    }
    let mut e = LOAD_ERROR.lock().unwrap_or_else(|p| p.into_inner());
    if e.is_none() {
        say_error(&format!("sdq: error: {msg}"));
        *e = Some(msg.to_string());
    }
}

/// The error that fails the model load in progress, once.
pub fn take_load_error() -> Option<String> {
    LOAD_ERROR.lock().unwrap_or_else(|p| p.into_inner()).take()
}

/// An error line on stderr; inside a host program also in the program's own
/// llama.cpp log callback, if it set one (`hooks::log_error`).
fn say_error(line: &str) {
    if EMBEDDED.load(Ordering::Acquire) {
        crate::hooks::log_error(line);
    } else {
        eprintln!("{line}");
    }
}

/// This process is a host program that loaded sdq's libllama.
pub fn embed() {
    EMBEDDED.store(true, Ordering::Release);
    allow_batch_abort();
}

/// The tool abandons a batch whose expert read failed and goes on (llama-server).
pub fn allow_batch_abort() {
    BATCH_ABORT.supported.store(true, Ordering::Release);
}

/// ggml's abort callback: true once after a batch was abandoned. ggml asks
/// after each node, and stops the graph at the first true; so when it asks
/// again after that, it runs the next graph, and the abandoned batch is over.
pub fn abort_requested() -> bool {
    match BATCH_ABORT.state.load(Ordering::Acquire) {
        REQUESTED => {
            BATCH_ABORT.state.store(STOPPING, Ordering::Release);
            true
        }
        STOPPING => {
            BATCH_ABORT.state.store(IDLE, Ordering::Release);
            false
        }
        _ => false,
    }
}

/// The error that abandoned the last batch, once.
pub fn take_batch_error() -> Option<String> {
    BATCH_ABORT.error.lock().unwrap_or_else(|p| p.into_inner()).take()
}

/// Runs `f` (a callback from C or C++, which nothing may unwind into),
/// turning a panic into a clean fatal error naming `what`.
pub fn guard<T>(what: &str, f: impl FnOnce() -> T) -> T {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|_| fatal(&format!("internal error in {what}")))
}

impl Runtime {
    fn lock_registry(&self) -> std::sync::MutexGuard<'_, Registry> {
        self.registry.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The loader opened file `idx` of a model: its first file starts a
    /// model (or, loaded again, as llama-bench does between tests, makes an
    /// earlier one current again).
    pub fn on_loader_file(&self, idx: u32, path: PathBuf) {
        // A tool checked its models before loading them (src/tools.rs); a
        // host program's load is checked here, and fails on a bad file.
        if idx == 0 && EMBEDDED.load(Ordering::Acquire) {
            if let Err(e) = crate::preflight::check_model(&path) {
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

    /// The model loading now has its weights in memory.
    pub fn on_model_loaded(&self) {
        let mut r = self.lock_registry();
        let current = r.current;
        if let Some(m) = r.models.get_mut(current) {
            m.loaded = true;
        }
    }

    /// A model with routed experts that the tool will load after its first
    /// (a draft model, `-md`): the pager waits for it (see `pager_if_ready`).
    pub fn await_model(&self, path: PathBuf) {
        *self.awaited.lock().unwrap_or_else(|p| p.into_inner()) = Some(path);
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
            return Err(Error::invalid(format!(
                "tensor {name} has type {}, which ggml's CPU backend cannot multiply; sdq cannot page it",
                ty.name()
            )));
        }
        let mut r = self.lock_registry();
        let name = renumbered(name, r.loading().layer_base);
        if let Some(n) = notice {
            if r.layout_notices.insert(n.clone()) {
                eprintln!("sdq: notice: {name}: {n}");
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
    /// prefetched experts are used ([`crate::pager::gate`]). Below two
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

    /// A context reserved `bytes` of compute buffers in host memory, of
    /// which `logits` would hold every token's logits: a generating tool
    /// asks for the last token's only, so that share is left to the
    /// reserve (a tool that asks for all of them, llama-perplexity, needs a
    /// reserve to match).
    pub fn on_compute_buffers(&self, bytes: u64, logits: u64) {
        let bytes = bytes.saturating_sub(logits);
        let rss = ProcMemory::read().rss_anon;
        log::debug!("a context reserved {} of compute buffers; the process holds {}", human(bytes), human(rss));
        let mut c = self.compute_buffers.lock().unwrap_or_else(|p| p.into_inner());
        // The latest of the largest: common's parameter fitting reserves a
        // context of the same size before the weights are read.
        if c.is_none_or(|(b, _)| bytes >= b) {
            *c = Some((bytes, rss));
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
        if self.pager.get().is_none() && EMBEDDED.load(Ordering::Acquire) && BATCH_ABORT.state.load(Ordering::Acquire) != IDLE {
            return None;
        }
        match self.try_pager(top_k) {
            Ok(p) => Some(p),
            // Inside a host program the batch fails (llama_decode returns
            // non-zero), its experts left out; a tool ends with the error.
            Err(e) if EMBEDDED.load(Ordering::Acquire) => {
                fail_batch(&e.to_string());
                None
            }
            Err(e) => fatal(&e.to_string()),
        }
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
            let _ = self.pager.set(made);
        }
        Ok(&self.pager.get().expect("the pager was just set").0)
    }

    fn create_pager(&self, top_k: usize) -> Result<(Pager, ArenaPlan), Error> {
        let (tensors, files, mapped) = {
            let r = self.lock_registry();
            (r.tensors.values().cloned().collect::<Vec<_>>(), r.files.clone(), r.mapped_hot_bytes())
        };
        let layout = Layout::build(&tensors, &files, self.options.direct_io.unwrap_or(true))?;
        layout.drop_cached();
        let rss = ProcMemory::read().rss_anon;
        let projector = self.projector_memory();
        let projector_bytes = projector.as_ref().map_or(0, |p| p.weights + p.compute);
        let compute = self.untouched_compute(rss);
        log::debug!("planning the arena: the process holds {}, compute buffers not yet touched {}", human(rss), human(compute));
        let held = budget::Held { anon: rss + projector_bytes + compute, mapped };
        let reserve = self.options.reserve.unwrap_or_else(|| budget::default_reserve(self.budget));
        let min_arena = layout.min_arena_bytes(top_k);
        let too_small = || {
            Error::invalid(format!(
                "RAM budget {} is too small: after loading, the process holds {} of anonymous memory{} and {} of mapped weights{}, the reserve is {} and one layer's top-{top_k} experts need {}; the minimum budget is {} (or lower --sdq-reserve)",
                human(self.budget),
                human(rss),
                match compute {
                    0 => String::new(),
                    c => format!(" (and its compute buffers {} more once used)", human(c)),
                },
                human(mapped),
                match (&self.options.mmproj, projector_bytes) {
                    (Some(path), b) if b > 0 => format!(", the projector {} takes {} more", path.display(), human(b)),
                    _ => String::new(),
                },
                human(reserve),
                human(min_arena),
                human(rss + compute + projector_bytes + mapped + reserve + min_arena)
            ))
        };
        let arena_bytes = budget::arena_bytes(self.budget, reserve, held, budget::rlimit_data()).map_err(|_| too_small())?;
        let slots = layout.plan_slots(arena_bytes, top_k).map_err(|_| too_small())?;
        let counts: Vec<usize> = slots.iter().map(|s| s.1).collect();
        let plan = ArenaPlan {
            reserve,
            rss_anon_at_start: rss,
            compute_untouched: compute,
            mapped_weight_bytes: mapped,
            arena_bytes,
            slots: slots.clone(),
            top_k,
            load_seconds: self.started.elapsed().as_secs_f64(),
            projector,
        };
        log::info!(
            "arena {} for {} of routed experts: {}",
            human(arena_bytes),
            human(layout.total_expert_bytes()),
            slots.iter().map(|(b, n)| format!("{n} slots of {}", human(*b as u64))).collect::<Vec<_>>().join(", ")
        );
        let readers = self.options.readers.unwrap_or(crate::pager::DEFAULT_READERS);
        let defaults = crate::pager::io::RetryPolicy::default();
        let retry = crate::pager::io::RetryPolicy {
            retries: self.options.read_retries.unwrap_or(defaults.retries),
            backoff: self.options.read_backoff_ms.map_or(defaults.backoff, std::time::Duration::from_millis),
        };
        let reader = ExpertReader::new(self.options.faults.clone()).with_retries(retry);
        let pages = self.options.pages.unwrap_or_default();
        let pager = Pager::new(layout, &counts, reader, readers, self.options.populate.unwrap_or_default(), self.options.policy.unwrap_or_default(), pages)?;
        if let Some(why) = pager.arena_fallback() {
            eprintln!("sdq: notice: {why}: the expert arena uses {}", pager.arena_backing().name());
        }
        if let (Some(hot), Some(path)) = (&self.hotset, &self.options.hotset_file) {
            hot.check_model(path, &geometry(pager.layout()))?;
            let counts: Vec<_> = hot.experts.iter().filter(|e| e.count > 0.0).map(|e| (e.key, e.count)).collect();
            let held: Vec<_> = hot.experts.iter().filter(|e| e.held).map(|e| e.key).collect();
            let n = pager.warm(&counts, &held);
            self.warm_listed.store(n as u64, Ordering::Relaxed);
            log::info!("warm start from {}: {n} of its {} experts to read between steps", path.display(), held.len());
        }
        if self.options.preload.unwrap_or(true) && pager.holds_every_expert() {
            let n = pager.preload();
            log::info!("the arena holds every routed expert: reading all {n} in the background");
        }
        Ok((pager, plan))
    }

    /// The memory of the projector the tool loads (`--mmproj`): its weights
    /// and the compute buffers mtmd reserves for its largest input. All of
    /// it is counted: every tool loads the text model, and so sizes the
    /// arena, before it loads the projector. None without a projector; a
    /// projector mtmd cannot read is left to the tool, which reports it.
    fn projector_memory(&self) -> Option<crate::inspect::Projector> {
        let path = self.options.mmproj.as_ref()?;
        match crate::inspect::projector_memory(path) {
            Ok(p) => {
                log::info!("projector {}: {} of weights and {} of compute buffers counted before the arena", path.display(), human(p.weights), human(p.compute));
                Some(p)
            }
            Err(e) => {
                log::warn!("{e}: the projector's memory is left to the reserve");
                None
            }
        }
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
        let (Some(path), Some((pager, _))) = (&self.options.hotset_file, self.pager.get()) else { return };
        let (counts, held) = pager.hot_set();
        let mut experts: std::collections::BTreeMap<crate::pager::ExpertKey, HotExpert> =
            counts.into_iter().map(|(key, count)| (key, HotExpert { key, count, held: false })).collect();
        for key in held {
            experts.entry(key).or_insert(HotExpert { key, count: 0.0, held: true }).held = true;
        }
        let set = HotSet { layers: geometry(pager.layout()), experts: experts.into_values().collect() };
        match set.save(path) {
            Ok(()) => log::info!("hot set of {} experts saved to {}", set.experts.iter().filter(|e| e.held).count(), path.display()),
            Err(e) => eprintln!("sdq: warning: {e}"),
        }
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
    fn hint_ubatch(&self, run: &crate::phases::PromptRun) {
        static SAID: AtomicBool = AtomicBool::new(false);
        let Some((pager, plan)) = self.pager.get() else { return };
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
        let Some(h) = run.ubatch_hint(compute, headroom) else { return };
        if SAID.swap(true, Ordering::Relaxed) {
            return;
        }
        eprintln!(
            "sdq: hint: a prompt of {} tokens ran in {} ubatches of {} and read {} of experts, {:.1} times the {} it touched (each ubatch reads its experts again); -ub {} (with -b at least that) would read about {}, and its compute buffers (about {} more) fit the budget",
            run.tokens,
            run.steps,
            run.ubatch,
            human(run.bytes_read),
            run.bytes_read as f64 / run.touched_bytes.max(1) as f64,
            human(run.touched_bytes),
            h.ubatch,
            human(h.reads),
            human(h.extra)
        );
    }

    fn pager_totals(&self) -> PagerTotals {
        self.pager.get().map_or_else(Default::default, |(p, _)| p.totals())
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
        let Some((pager, plan)) = self.pager.get() else { return };
        let mut watch = self.watch.lock().unwrap_or_else(|p| p.into_inner());
        let w = watch.get_or_insert_with(|| {
            let bounds = crate::pressure::Plan { budget: self.budget, arena: plan.arena_bytes, min_arena: pager.layout().min_arena_bytes(plan.top_k) };
            crate::pressure::Watch::new(bounds, self.options.budget_auto)
        });
        w.poll(pager, plan.top_k, rss_anon);
    }

    fn sample_memory(&self) -> ProcMemory {
        let m = ProcMemory::read();
        self.peak_rss_anon.fetch_max(m.rss_anon, Ordering::Relaxed);
        self.max_swap.fetch_max(m.vm_swap, Ordering::Relaxed);
        m
    }

    /// Writes the stats file (if asked for) and, with `summary`, the summary
    /// line on stderr; once.
    ///
    /// Returns false if the budget was not honoured and nothing else said
    /// so: no expert was ever paged (the model's graph uses none of its
    /// expert tensors), so no arena was fitted to the budget, and the
    /// process held more than it; the error line is printed here.
    pub fn finish(&self, summary: bool) -> bool {
        if self.finished.swap(true, Ordering::SeqCst) {
            return true;
        }
        self.sample_memory();
        let totals = self.pager_totals();
        let ended = self.lock_phases().end_run(totals);
        if let Some(run) = ended {
            self.hint_ubatch(&run);
        }
        if let Some(trace) = &self.trace {
            let mut t = trace.lock().unwrap_or_else(|p| p.into_inner());
            if let Err(e) = t.flush() {
                eprintln!("sdq: error: {e}");
            }
        }
        self.save_hotset();
        self.write_stats(true);
        if summary {
            eprintln!("{}", self.summary_line());
        }
        let peak = self.peak_rss_anon.load(Ordering::Relaxed);
        if self.pager.get().is_none() && peak > self.budget {
            eprintln!(
                "sdq: error: RAM budget {} was not honoured: the process held {} of anonymous memory, and no routed expert was paged (the model's graph uses none of its expert tensors), so nothing could be kept out of memory; the budget must be at least {}",
                human(self.budget),
                human(peak),
                human(peak)
            );
            return false;
        }
        true
    }

    /// Writes the stats file, if one was asked for. A regular file (or a new
    /// one) is replaced whole through a temporary file and a rename, so a
    /// reader never sees half of it; anything else (`/dev/stdout`, a pipe) is
    /// written directly, and only once, at the end. A failure is a warning,
    /// printed once: the run's output matters more than its figures.
    fn write_stats(&self, last: bool) {
        static WARNED: AtomicBool = AtomicBool::new(false);
        static WRITING: Mutex<()> = Mutex::new(());
        let Some(path) = &self.options.stats_file else { return };
        let _one_writer = WRITING.lock().unwrap_or_else(|p| p.into_inner());
        if !last && self.finished.load(Ordering::SeqCst) {
            return; // the final figures are (being) written: never overwrite them
        }
        let mut stats = self.stats_json();
        stats["final"] = serde_json::Value::Bool(last);
        let text = serde_json::to_string_pretty(&stats).expect("stats serialize") + "\n";
        let regular = std::fs::metadata(path).map(|m| m.is_file()).unwrap_or(true);
        let result = if regular {
            write_whole(path, &text)
        } else if last {
            std::fs::write(path, &text)
        } else {
            Ok(())
        };
        if let Err(e) = result {
            if !WARNED.swap(true, Ordering::SeqCst) {
                eprintln!("sdq: warning: cannot write stats to {}: {e}", path.display());
            }
        }
    }

    fn summary_line(&self) -> String {
        let peak = self.peak_rss_anon.load(Ordering::Relaxed);
        let swap = self.max_swap.load(Ordering::Relaxed);
        match self.pager.get() {
            None => format!(
                "sdq: no routed experts were paged (the model has none, or none were used); peak anonymous RSS {} of {} budget, swap {}",
                human(peak),
                human(self.budget),
                human(swap)
            ),
            Some((pager, _)) => {
                let t = pager.totals();
                let (prompt, decode) = self.phase_totals();
                let tokens = prompt.tokens + decode.tokens;
                format!(
                    "sdq: hit {:.1} % | {:.2} MiB read/token | peak anonymous RSS {} of {} budget | swap {}",
                    100.0 * t.hits as f64 / (t.hits + t.misses).max(1) as f64,
                    t.bytes_read as f64 / budget::MIB as f64 / tokens.max(1) as f64,
                    human(peak),
                    human(self.budget),
                    human(swap)
                )
            }
        }
    }

    /// The figures of the stats file in `report`'s format (llama-server's
    /// `/metrics` and `/props`).
    pub fn report(&self, report: crate::metrics::Report) -> String {
        crate::metrics::render(report, &self.stats_json())
    }

    fn stats_json(&self) -> serde_json::Value {
        use serde_json::json;
        let (files, models) = {
            let r = self.lock_registry();
            // Every model loaded with its weights, and where its layers start
            // among the pager's (a draft model's follow the target's).
            let models: Vec<_> = r.models.iter().filter(|m| m.loaded).map(|m| json!({ "path": m.path.display().to_string(), "first_layer": m.layer_base })).collect();
            (r.files.clone(), models)
        };
        let (prompt, decode) = self.phase_totals();
        let (tokens_prompt, tokens_generated) = (prompt.tokens, decode.tokens);
        let tokens = tokens_prompt + tokens_generated;
        let mem = ProcMemory::read();
        let mut v = json!({
            "model": files.get(&0).map(|p| p.display().to_string()),
            "models": models,
            "budget_bytes": self.budget,
            "tokens": { "prompt": tokens_prompt, "generated": tokens_generated },
            "peak_rss_anon_bytes": self.peak_rss_anon.load(Ordering::Relaxed),
            "vm_swap_bytes": self.max_swap.load(Ordering::Relaxed).max(mem.vm_swap),
            "vm_hwm_bytes": mem.vm_hwm,
            "paged": self.pager.get().is_some(),
        });
        if let Some((pager, plan)) = self.pager.get() {
            let c = pager.counts();
            let (hits, misses) = c.per_layer.iter().fold((0, 0), |(h, m), (_, l)| (h + l.hits, m + l.misses));
            let layers_per_class = pager.layout().layers_per_class();
            let o = v.as_object_mut().expect("object");
            o.insert("reserve_bytes".into(), json!(plan.reserve));
            o.insert("rss_anon_after_load_bytes".into(), json!(plan.rss_anon_at_start));
            o.insert("compute_untouched_bytes".into(), json!(plan.compute_untouched));
            o.insert("compute_buffer_bytes".into(), json!(self.compute_buffers.lock().unwrap_or_else(|p| p.into_inner()).map_or(0, |c| c.0)));
            o.insert("mapped_weight_bytes".into(), json!(plan.mapped_weight_bytes));
            // The arena's size now: its plan unless memory pressure took
            // some back (see `pressure`), the slots it may fill, and its changes.
            let watch = self.watch.lock().unwrap_or_else(|p| p.into_inner());
            o.insert("arena_bytes".into(), json!(watch.as_ref().map_or(plan.arena_bytes, |w| w.arena)));
            o.insert("arena_planned_bytes".into(), json!(plan.arena_bytes));
            o.insert("arena_slot_bytes".into(), json!(pager.arena_bytes_in_use()));
            o.insert("arena_smallest_bytes".into(), json!(watch.as_ref().map_or(plan.arena_bytes, |w| w.smallest)));
            o.insert("arena_shrinks".into(), json!(watch.as_ref().map_or(0, |w| w.shrinks)));
            o.insert("arena_grows".into(), json!(watch.as_ref().map_or(0, |w| w.grows)));
            o.insert("room_bytes".into(), json!(watch.as_ref().map_or(self.budget, |w| w.room)));
            drop(watch);
            // Which pages the arena got: the kind it asked for, and how much
            // of it the kernel holds in huge pages now.
            o.insert("arena_pages".into(), json!(pager.arena_backing().name()));
            o.insert("arena_huge_bytes".into(), json!(pager.arena_huge_bytes()));
            o.insert("arena_resident_bytes".into(), json!(pager.arena_resident_bytes()));
            o.insert("arena_filled_bytes".into(), json!(pager.arena_filled_bytes()));
            o.insert("arena_populate".into(), json!(self.options.populate.unwrap_or_default().name()));
            let (minor, major) = budget::page_faults();
            o.insert("minor_faults".into(), json!(minor));
            o.insert("major_faults".into(), json!(major));
            o.insert("load_seconds".into(), json!(plan.load_seconds));
            o.insert("projector_weights_bytes".into(), json!(plan.projector.as_ref().map_or(0, |p| p.weights)));
            o.insert("projector_compute_bytes".into(), json!(plan.projector.as_ref().map_or(0, |p| p.compute)));
            o.insert("top_k".into(), json!(plan.top_k));
            // Paged tensors by the layout their experts take in the arena
            // (stock's: "plain", or a repacked layout such as "q4_K_8x8_q8_K").
            let mut layouts: BTreeMap<&str, u64> = BTreeMap::new();
            for part in pager.layout().layers.values().flat_map(|l| &l.parts) {
                *layouts.entry(part.layout.name()).or_default() += 1;
            }
            o.insert("expert_layouts".into(), json!(layouts));
            // Repacked layouts converted with sdq's faster routine (checked
            // against ggml's bytes at load) rather than ggml's own.
            let fast: BTreeSet<&str> = pager
                .layout()
                .layers
                .values()
                .flat_map(|l| &l.parts)
                .filter_map(|p| match p.layout {
                    WeightLayout::Repacked(r) if r.fast() == Some(true) => Some(r.name()),
                    _ => None,
                })
                .collect();
            o.insert("fast_conversions".into(), json!(fast));
            o.insert(
                "slot_classes".into(),
                json!(plan
                    .slots
                    .iter()
                    .zip(&layers_per_class)
                    .zip(pager.slots_in_use())
                    .map(|((&(bytes, slots), &layers), in_use)| json!({ "expert_bytes": bytes, "slots": slots, "slots_in_use": in_use, "layers": layers }))
                    .collect::<Vec<_>>()),
            );
            o.insert(
                "layers".into(),
                json!(c
                    .per_layer
                    .iter()
                    .map(|(l, n)| {
                        let expert_bytes = pager.layout().layers[l].expert_bytes;
                        json!({
                            "layer": l,
                            "expert_bytes": expert_bytes,
                            "hits": n.hits,
                            "misses": n.misses,
                            "rereads": n.rereads,
                            "prefetched": n.prefetched,
                            "prefetch_used": n.prefetch_used,
                            "prefetch_late": n.prefetch_late,
                            "prefetch_wasted": n.prefetch_wasted,
                            "preloaded": n.preloaded,
                        })
                    })
                    .collect::<Vec<_>>()),
            );
            o.insert("hits".into(), json!(hits));
            o.insert("misses".into(), json!(misses));
            let sum = |f: fn(&crate::pager::LayerCounts) -> u64| c.per_layer.iter().map(|(_, l)| f(l)).sum::<u64>();
            o.insert("rereads".into(), json!(sum(|l| l.rereads)));
            // Tries repeated after a transient read error, and expert reads
            // that failed even so (each stopped the batch that needed it).
            o.insert("read_retries".into(), json!(c.read_retries));
            o.insert("read_failures".into(), json!(c.read_failures));
            // Prefetched experts a batch then used are hits; every prefetch is a read.
            o.insert("prefetched".into(), json!(sum(|l| l.prefetched)));
            o.insert("prefetch_used".into(), json!(sum(|l| l.prefetch_used)));
            o.insert("prefetch_late".into(), json!(sum(|l| l.prefetch_late)));
            o.insert("prefetch_wasted".into(), json!(sum(|l| l.prefetch_wasted)));
            o.insert("preloaded".into(), json!(sum(|l| l.preloaded)));
            // The hot set's (--sdq-hotset) experts listed at start, those read
            // (also preloaded; one already held is not), and those left.
            o.insert("warm_start_listed".into(), json!(self.warm_listed.load(Ordering::Relaxed)));
            o.insert("warm_start_experts".into(), json!(c.warm_read));
            o.insert("warm_start_pending".into(), json!(c.warm_pending));
            o.insert("hit_rate".into(), json!(hits as f64 / (hits + misses).max(1) as f64));
            o.insert("bytes_read".into(), json!(c.bytes_read));
            // With direct I/O, reads are 4 KiB-aligned supersets of the expert's range.
            o.insert("device_bytes_read".into(), json!(c.device_bytes));
            let direct = pager.layout().layers.values().flat_map(|l| &l.parts).filter(|p| p.direct.is_some()).count();
            o.insert("direct_io".into(), json!(direct > 0));
            o.insert("reads".into(), json!(c.reads));
            o.insert("read_seconds".into(), json!(c.read_seconds));
            o.insert("converted_parts".into(), json!(c.converted));
            o.insert("convert_seconds".into(), json!(c.convert_seconds));
            o.insert("miss_batches".into(), json!(c.miss_batches));
            o.insert("miss_batch_bytes".into(), json!(c.miss_batch_bytes));
            o.insert("miss_batch_seconds".into(), json!(c.miss_batch_seconds));
            o.insert(
                "miss_batch_mib_per_s".into(),
                json!(if c.miss_batch_seconds > 0.0 { c.miss_batch_bytes as f64 / budget::MIB as f64 / c.miss_batch_seconds } else { 0.0 }),
            );
            // Prompt and decode mixed; the phases apart are `prompt` and `decode`.
            o.insert("mib_read_per_token".into(), json!(c.bytes_read as f64 / budget::MIB as f64 / tokens.max(1) as f64));
            o.insert("prompt".into(), prompt.to_json());
            o.insert("decode".into(), decode.to_json());
            o.insert("expert_bytes_total".into(), json!(pager.layout().total_expert_bytes()));
        }
        v
    }
}

/// Replaces the file at `path` with `text` whole, through a temporary file
/// beside it and a rename, so a reader never sees half of it (the stats
/// file, hot sets).
pub(crate) fn write_whole(path: &std::path::Path, text: &str) -> std::io::Result<()> {
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let tmp = path.with_file_name(format!(".{name}.{}.tmp", std::process::id()));
    std::fs::write(&tmp, text).and_then(|()| std::fs::rename(&tmp, path)).inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })
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
