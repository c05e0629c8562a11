//! The run's figures: the stats file (`--sdq-stats`), the summary line at
//! exit, and the text llama-server's `/metrics` and `/props` add.

use super::Runtime;
use crate::engine::ffi::ggml::WeightLayout;
use crate::engine::memory::budget::{self, ProcMemory};
use crate::files::write_whole;
use crate::units::{human, MIB};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::Duration;

/// How old the arena's huge-page figure may be in a snapshot or a /metrics
/// scrape: reading it walks every mapping's page tables.
const SNAPSHOT_HUGE_AGE: Duration = Duration::from_secs(15);

impl Runtime {
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
                stderr_line!("sdq: error: {e}");
            }
        }
        self.save_hotset();
        self.write_stats(true);
        if let Some(line) = summary.then(|| self.summary_line()).flatten() {
            stderr_line!("{line}");
        }
        let peak = self.peak_rss_anon.load(Ordering::Relaxed);
        // Over the budget with nothing paged, though batches ran and none
        // failed: the model's graph never used its experts.
        let failed = super::failure::failed();
        let computed = self.ubatches.load(Ordering::Relaxed) > 0 && failed.batches == 0 && failed.loads == 0;
        if self.pager.latest().is_none() && peak > self.budget && computed {
            stderr_line!(
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
    pub(super) fn write_stats(&self, last: bool) {
        static WARNED: AtomicBool = AtomicBool::new(false);
        static WRITING: Mutex<()> = Mutex::new(());
        let Some(path) = &self.options.stats_file else { return };
        let _one_writer = WRITING.lock().unwrap_or_else(|p| p.into_inner());
        if !last && self.finished.load(Ordering::SeqCst) {
            return; // the final figures are (being) written: never overwrite them
        }
        let mut stats = self.stats_json(last);
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
                stderr_line!("sdq: warning: cannot write stats to {}: {e}", path.display());
            }
        }
    }

    /// The run summed up in one line; None when no model was loaded (a
    /// tool that stopped at its arguments, as stock's does, says nothing more).
    pub(super) fn summary_line(&self) -> Option<String> {
        let peak = self.peak_rss_anon.load(Ordering::Relaxed);
        let swap = self.max_swap.load(Ordering::Relaxed);
        let on_nodes = {
            let r = self.lock_registry();
            let nodes: Vec<String> = r.on_nodes.iter().map(|(e, (a, b))| format!("layers {a}-{b} on {e}")).collect();
            (!nodes.is_empty()).then(|| format!(" | experts paged on rpc nodes: {}", nodes.join(", ")))
        };
        let failed = super::failure::failed();
        let first = failed.first.as_deref().unwrap_or_default();
        let line = match self.pager.latest() {
            None if self.lock_registry().models.is_empty() && self.models_loaded.load(Ordering::Relaxed) == 0 && failed.loads == 0 => return None,
            None if on_nodes.is_some() => {
                format!("sdq: no routed experts were paged here; peak anonymous RSS {} of {} budget, swap {}", human(peak), human(self.budget), human(swap))
            }
            None => {
                // What kept the experts out, said after the run's errors.
                let why = if failed.batches > 0 {
                    format!("{} failed before any was read: {first}", count(failed.batches, "batch", "batches"))
                } else if failed.loads > 0 {
                    format!("{} failed: {first}", count(failed.loads, "model load or context", "model loads or contexts"))
                } else if let Some(m) = self.lock_registry().models.iter().find(|m| !m.loaded).filter(|_| self.ubatches.load(Ordering::Relaxed) == 0) {
                    format!("{} did not load", m.path.display())
                } else if self.ubatches.load(Ordering::Relaxed) == 0 {
                    "nothing was decoded".to_string()
                } else {
                    "the model has none, or none were used".to_string()
                };
                format!("sdq: no routed experts were paged ({why}); peak anonymous RSS {} of {} budget, swap {}", human(peak), human(self.budget), human(swap))
            }
            Some(_) => {
                let t = self.pager_totals();
                let (prompt, decode) = self.phase_totals();
                let tokens = prompt.tokens + decode.tokens;
                format!(
                    "sdq: hit {:.1} % | {:.2} MiB read/token | peak anonymous RSS {} of {} budget | swap {}",
                    100.0 * t.hits as f64 / (t.hits + t.misses).max(1) as f64,
                    t.bytes_read as f64 / MIB as f64 / tokens.max(1) as f64,
                    human(peak),
                    human(self.budget),
                    human(swap)
                ) + &match failed.batches {
                    0 => String::new(),
                    n => format!(" | {} failed", count(n, "batch", "batches")),
                }
            }
        };
        Some(line + on_nodes.as_deref().unwrap_or(""))
    }

    /// The figures of the stats file in `report`'s format (llama-server's
    /// `/metrics` and `/props`).
    pub fn report(&self, report: crate::engine::runtime::metrics::Report) -> String {
        use crate::engine::runtime::metrics;
        if report == metrics::Report::Prompt {
            // Asked after every batch of a streamed prompt: not the whole
            // stats object.
            let (tokens, read, touched) = self.lock_phases().prompt_so_far(self.pager_totals());
            return metrics::prompt_so_far(tokens, read, touched);
        }
        metrics::render(report, &self.stats_json(false))
    }

    /// The stats file's figures; `last` for the final ones, which read
    /// everything anew (a snapshot or a /metrics scrape may give figures
    /// that are costly to read as they were up to `SNAPSHOT_HUGE_AGE` ago).
    pub(super) fn stats_json(&self, last: bool) -> serde_json::Value {
        use serde_json::json;
        let (files, models) = {
            let r = self.lock_registry();
            // Every model loaded with its weights, and where its layers start
            // among the pager's (a draft model's follow the target's).
            let models: Vec<_> =
                r.models.iter().filter(|m| m.loaded).map(|m| json!({ "path": m.path.display().to_string(), "first_layer": m.layer_base })).collect();
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
            "paged": self.pager.latest().is_some(),
        });
        // A prompt's ubatches computed together, layer by layer.
        let g = self.groups_computed();
        let groups = json!({
            "groups": g.computed,
            "ubatches": g.ubatches,
            "peak_bytes": g.peak_bytes,
            "no_room": g.refused,
            "arena_lent_bytes": g.lent_bytes,
            "shared": g.shared,
            "shared_layers": g.shared_layers,
            "capacity_ubatches": g.capacity,
        });
        v.as_object_mut().expect("object").insert("prompt_groups".into(), groups);
        if let Some((pager, plan)) = self.pager.latest() {
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
            let held = pager.arena_pages_held(if last { Duration::ZERO } else { SNAPSHOT_HUGE_AGE });
            o.insert("arena_huge_bytes".into(), json!(held.map(|h| h.huge)));
            o.insert("arena_resident_bytes".into(), json!(held.map(|h| h.resident)));
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
                            "prediction_held": n.prediction_held,
                            "prediction_missed": n.prediction_missed,
                            "preloaded": n.preloaded,
                            "read_wait_seconds": n.waited_us as f64 / 1e6,
                        })
                    })
                    .collect::<Vec<_>>()),
            );
            o.insert("hits".into(), json!(hits));
            o.insert("misses".into(), json!(misses));
            let sum = |f: fn(&crate::engine::pager::LayerCounts) -> u64| c.per_layer.iter().map(|(_, l)| f(l)).sum::<u64>();
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
            o.insert("prediction_held".into(), json!(sum(|l| l.prediction_held)));
            o.insert("prediction_missed".into(), json!(sum(|l| l.prediction_missed)));
            o.insert("preloaded".into(), json!(sum(|l| l.preloaded)));
            // Thread-seconds the expert ops waited for reads: what the
            // reads added to the compute.
            o.insert("read_wait_seconds".into(), json!(sum(|l| l.waited_us) as f64 / 1e6));
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
                json!(if c.miss_batch_seconds > 0.0 { c.miss_batch_bytes as f64 / MIB as f64 / c.miss_batch_seconds } else { 0.0 }),
            );
            // Prompt and decode mixed; the phases apart are `prompt` and `decode`.
            o.insert("mib_read_per_token".into(), json!(c.bytes_read as f64 / MIB as f64 / tokens.max(1) as f64));
            o.insert("prompt".into(), prompt.to_json());
            o.insert("decode".into(), decode.to_json());
            o.insert("expert_bytes_total".into(), json!(pager.layout().total_expert_bytes()));
        }
        v
    }
}

/// "1 batch", "3 batches".
fn count(n: u64, one: &str, many: &str) -> String {
    format!("{n} {}", if n == 1 { one } else { many })
}
