//! The arena's plan: once every awaited model and its contexts hold their
//! memory, what is left of the budget becomes the pager's slots.

use super::{geometry, Runtime};
use crate::engine::memory::budget::{self, ProcMemory};
use crate::engine::model::accounting::{projector_memory, Projector};
use crate::engine::pager::io::ExpertReader;
use crate::engine::pager::layout::Layout;
use crate::engine::pager::Pager;
use crate::error::Error;
use crate::units::human;
use std::sync::atomic::Ordering;

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
    pub projector: Option<Projector>,
}

impl Runtime {
    pub(super) fn create_pager(&self, top_k: usize) -> Result<(Pager, ArenaPlan), Error> {
        let (layout, plan) = self.plan_arena(top_k)?;
        layout.drop_cached();
        let counts: Vec<usize> = plan.slots.iter().map(|s| s.1).collect();
        log::info!(
            "arena {} for {} of routed experts: {}",
            human(plan.arena_bytes),
            human(layout.total_expert_bytes()),
            plan.slots.iter().map(|(b, n)| format!("{n} slots of {}", human(*b as u64))).collect::<Vec<_>>().join(", ")
        );
        let readers = self.options.readers.unwrap_or(crate::engine::pager::DEFAULT_READERS);
        let defaults = crate::engine::pager::io::RetryPolicy::default();
        let retry = crate::engine::pager::io::RetryPolicy {
            retries: self.options.read_retries.unwrap_or(defaults.retries),
            backoff: self.options.read_backoff_ms.map_or(defaults.backoff, std::time::Duration::from_millis),
        };
        let reader = ExpertReader::new(self.options.faults.clone()).with_retries(retry);
        let pages = self.options.pages.unwrap_or_default();
        let pager =
            Pager::new(layout, &counts, reader, readers, self.options.populate.unwrap_or_default(), self.options.policy.unwrap_or_default(), top_k, pages)?;
        if let Some(why) = pager.arena_fallback() {
            stderr_line!("sdq: notice: {why}: the expert arena uses {}", pager.arena_backing().name());
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

    /// The arena's plan for the models loaded so far: the experts' layout
    /// and the slots what the process holds leaves of the budget; an error
    /// names the minimum budget when it is too small for one layer's top-k.
    fn plan_arena(&self, top_k: usize) -> Result<(Layout, ArenaPlan), Error> {
        let (tensors, files, mapped) = {
            let r = self.lock_registry();
            (r.tensors.values().cloned().collect::<Vec<_>>(), r.files.clone(), r.mapped_hot_bytes())
        };
        let layout = Layout::build(&tensors, &files, self.options.direct_io.unwrap_or(true))?;
        let rss = ProcMemory::read().rss_anon;
        let projector = self.projector_memory();
        let projector_bytes = projector.as_ref().map_or(0, |p| p.weights + p.compute);
        let compute = self.untouched_compute(rss);
        log::debug!("planning the arena: the process holds {}, compute buffers not yet touched {}", human(rss), human(compute));
        let held = budget::Held { anon: rss + projector_bytes + compute, mapped };
        let reserve = self.options.reserve.unwrap_or_else(|| budget::default_reserve(self.budget));
        let min_arena = layout.min_arena_bytes(top_k);
        let minimum = rss + compute + projector_bytes + mapped + reserve + min_arena;
        let too_small = || {
            Error::budget(self.budget, Some(minimum), format!(
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
                human(minimum)
            ))
        };
        let arena_bytes = budget::arena_bytes(self.budget, reserve, held, budget::rlimit_data()).map_err(|_| too_small())?;
        let slots = layout.plan_slots(arena_bytes, top_k).map_err(|_| too_small())?;
        let plan = ArenaPlan {
            reserve,
            rss_anon_at_start: rss,
            compute_untouched: compute,
            mapped_weight_bytes: mapped,
            arena_bytes,
            slots,
            top_k,
            load_seconds: self.started.elapsed().as_secs_f64(),
            projector,
        };
        Ok((layout, plan))
    }

    /// Inside a host program, a context is made only if the budget holds
    /// the arena's minimum beside the model and this context: the program
    /// hears it where it can act on it (`llama_init_from_model` returns
    /// NULL), not at its first batch. Nothing is planned for good here: the
    /// arena is planned at the first batch, once every model is loaded.
    pub(super) fn check_budget_for_context(&self) -> Result<(), Error> {
        if self.pager.get().is_some() {
            return Ok(());
        }
        let Some(top_k) = self.loading_top_k()? else { return Ok(()) };
        if self.lock_registry().tensors.is_empty() {
            return Ok(());
        }
        self.plan_arena(top_k).map(|_| ())
    }

    /// The experts a token uses per layer in the model loading now (its
    /// GGUF metadata), or None without one or without routed experts.
    fn loading_top_k(&self) -> Result<Option<usize>, Error> {
        let path = {
            let r = self.lock_registry();
            if r.models.is_empty() {
                return Ok(None);
            }
            r.loading().path.clone()
        };
        let g = crate::engine::model::gguf::Gguf::open(&path)?;
        Ok(g.arch_u64("expert_used_count").map(|k| k as usize))
    }

    /// The memory of the projector the tool loads (`--mmproj`): its weights
    /// and the compute buffers mtmd reserves for its largest input. All of
    /// it is counted: every tool loads the text model, and so sizes the
    /// arena, before it loads the projector. None without a projector; a
    /// projector mtmd cannot read is left to the tool, which reports it.
    pub(super) fn projector_memory(&self) -> Option<Projector> {
        let path = self.options.mmproj.as_ref()?;
        match projector_memory(path) {
            Ok(p) => {
                log::info!(
                    "projector {}: {} of weights and {} of compute buffers counted before the arena",
                    path.display(),
                    human(p.weights),
                    human(p.compute)
                );
                Some(p)
            }
            Err(e) => {
                log::warn!("{e}: the projector's memory is left to the reserve");
                None
            }
        }
    }
}
