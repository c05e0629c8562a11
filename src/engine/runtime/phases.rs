//! The prompt's and the decode's figures apart: each step's wall time and
//! the expert bytes read while it ran, summed by phase, so one run's stats
//! give a decode's MiB per token and tok/s without the prompt mixed in.
//!
//! A step is one `llama_decode` batch, from its first paged layer to the
//! next step's first paged layer (what a tool's own timings count, less the
//! layers before the first MoE layer). A step of more than one token is
//! prompt; of one, decode. When more than `IDLE` passes between a step's
//! last paged layer and the next step (a server waiting for a request), the
//! step is closed at its last paged layer instead, so idle time is not
//! counted as decoding.
//!
//! Consecutive prompt steps are one prompt run: what they read against the
//! expert bytes they touched says whether a larger `-ub` would read fewer
//! (see [`UbatchHint`]).

use crate::engine::pager::ExpertKey;
pub use crate::engine::pager::PagerTotals;
use std::collections::HashSet;
use std::time::{Duration, Instant};

/// A gap between steps longer than this is idle, not part of the step.
const IDLE: Duration = Duration::from_secs(1);

/// One phase's totals.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PhaseTotals {
    pub steps: u64,
    pub tokens: u64,
    pub bytes_read: u64,
    /// Expert uses that found the expert held, and those that read it.
    pub hits: u64,
    pub misses: u64,
    /// Of the hits, those that found an expert a prefetch had read.
    pub prefetch_used: u64,
    pub seconds: f64,
    /// Prompt steps: the bytes of the distinct experts each prompt touched,
    /// summed over prompts (what reading each of them once would read).
    pub touched_bytes: u64,
    /// Microseconds the expert ops' threads waited for reads, summed over
    /// threads: the reads the phase did not hide behind its compute.
    pub waited_us: u64,
}

impl PhaseTotals {
    pub fn to_json(&self) -> serde_json::Value {
        const MIB: f64 = crate::units::MIB as f64;
        let lookups = self.hits + self.misses;
        let share = |n: u64| if lookups > 0 { n as f64 / lookups as f64 } else { 0.0 };
        serde_json::json!({
            "steps": self.steps,
            "tokens": self.tokens,
            "bytes_read": self.bytes_read,
            "hits": self.hits,
            "misses": self.misses,
            "prefetch_used": self.prefetch_used,
            "hit_rate": share(self.hits),
            // Found held with no read for this step: hits less the prefetched
            // ones (what a replay of the routing counts as hits).
            "held_rate": share(self.hits - self.prefetch_used.min(self.hits)),
            "seconds": self.seconds,
            "touched_bytes": self.touched_bytes,
            "read_wait_seconds": self.waited_us as f64 / 1e6,
            "mib_read_per_token": if self.tokens > 0 { self.bytes_read as f64 / MIB / self.tokens as f64 } else { 0.0 },
            "tokens_per_second": if self.seconds > 0.0 { self.tokens as f64 / self.seconds } else { 0.0 },
            "mib_read_per_second": if self.seconds > 0.0 { self.bytes_read as f64 / MIB / self.seconds } else { 0.0 },
        })
    }
}

/// The step being timed.
#[derive(Clone, Copy, Debug)]
struct Open {
    decode: bool,
    tokens: u64,
    started: Instant,
    at_start: PagerTotals,
    /// When its last paged layer finished, if it has.
    ended: Option<Instant>,
}

/// Steps timed and summed by phase.
#[derive(Debug, Default)]
pub struct PhaseClock {
    open: Option<Open>,
    pub prompt: PhaseTotals,
    pub decode: PhaseTotals,
    /// The prompt steps since the last decode step or the last prompt
    /// computed from its start.
    run: Option<PromptRun>,
    /// The next step starts its sequence (at position 0), as llama.cpp
    /// said of the ubatch about to be computed.
    next_starts_sequence: bool,
}

/// Consecutive prompt steps (ubatches of one prompt): their tokens, the
/// bytes they read and the distinct experts they touched.
#[derive(Clone, Debug, Default)]
pub struct PromptRun {
    pub steps: u64,
    pub tokens: u64,
    /// The largest step: the run's ubatch.
    pub ubatch: u64,
    /// The last step's tokens.
    last: u64,
    /// A step after one smaller than the ubatch, or larger than an earlier
    /// one: not one prompt's ubatches (which are all the ubatch but the
    /// last) but, say, a draft's verification batches back to back.
    uneven: bool,
    bytes_at_start: u64,
    pub bytes_read: u64,
    touched: HashSet<ExpertKey>,
    pub touched_bytes: u64,
}

/// The tokens a context holds (`n_ctx`) and computes in one ubatch
/// (`n_ubatch`); 0 where not known. One sequence's prompt fits in the
/// context, and its ubatches are `n_ubatch` tokens but the last.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ContextSize {
    pub n_ctx: u64,
    pub n_ubatch: u64,
}

impl ContextSize {
    /// The larger of each, over the contexts a process makes (a draft
    /// model's is another).
    pub fn widen(&mut self, other: ContextSize) {
        self.n_ctx = self.n_ctx.max(other.n_ctx);
        self.n_ubatch = self.n_ubatch.max(other.n_ubatch);
    }
}

/// A larger `-ub` that would read fewer expert bytes for a prompt like the
/// last one, and whose compute buffers fit the headroom the budget has left.
/// Each ubatch reads an expert it touches at most once, so one ubatch of the
/// whole prompt reads at most the bytes the run touched.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct UbatchHint {
    pub ubatch: u64,
    /// Bytes that ubatch would read, about: its ubatches each reading what
    /// one of the run's read plus what the arena gives up for the larger
    /// buffers (never below the touched bytes).
    pub reads: u64,
    /// Compute buffer bytes it needs beyond the run's ubatch, about.
    pub extra: u64,
}

impl PromptRun {
    /// The largest ubatch, of powers of two times the run's and one that
    /// holds the whole prompt, that would take fewer ubatches and whose compute
    /// buffers (`compute` bytes at the run's ubatch, growing in proportion)
    /// fit in `headroom`; None if the run read its experts about once
    /// already (at most 1.25 times the bytes it touched). Steps that
    /// cannot be one prompt's ubatches in a context of `size` (smaller than
    /// its ubatch, or more tokens than it holds) were batches of their
    /// own, as llama-bench's warm-up and repetitions of a prompt are, which
    /// a larger `-ub` would not join: no hint. Nor is one larger than the
    /// context, to which llama.cpp cuts `-ub`.
    pub fn ubatch_hint(&self, compute: u64, headroom: u64, size: ContextSize) -> Option<UbatchHint> {
        let known = |n: u64| if n == 0 { u64::MAX } else { n };
        if !self.read_one_prompt_again(size) || self.ubatch == 0 {
            return None;
        }
        // One ubatch of the whole prompt: the smaller of the first doubling
        // that holds it and the prompt rounded up to 256.
        let doublings = || std::iter::successors(Some(self.ubatch * 2), |u| Some(u * 2));
        let doubling = doublings().find(|&u| u >= self.tokens).unwrap_or(self.tokens);
        let whole = doubling.min(self.tokens.div_ceil(256) * 256).min(known(size.n_ctx));
        let mut candidates: Vec<u64> = doublings().take_while(|&u| u < whole).collect();
        candidates.push(whole);
        candidates.into_iter().rev().find_map(|ubatch| {
            let steps = self.tokens.div_ceil(ubatch);
            let extra = (compute as f64 * (ubatch as f64 / self.ubatch as f64 - 1.0)) as u64;
            // The arena gives the larger buffers their room: at worst each
            // byte it loses is read again by every ubatch.
            let per_step = self.bytes_read as f64 / self.steps as f64 + extra as f64;
            let reads = ((per_step * steps as f64) as u64).max(self.touched_bytes);
            (steps < self.steps && extra <= headroom && (reads as f64) < 0.8 * self.bytes_read as f64).then_some(UbatchHint { ubatch, reads, extra })
        })
    }
}

impl PromptRun {
    /// "a prompt of N tokens ran in S `steps` M and read X of experts, R
    /// times the Y it touched", for the hints.
    pub fn what_it_read(&self, steps: &str) -> String {
        use crate::units::human;
        format!(
            "a prompt of {} tokens ran in {} {steps} {} and read {} of experts, {:.1} times the {} it touched",
            self.tokens,
            self.steps,
            self.ubatch,
            human(self.bytes_read),
            self.bytes_read as f64 / self.touched_bytes.max(1) as f64,
            human(self.touched_bytes)
        )
    }

    /// True if the run's steps are one prompt's (each as large as a context
    /// of `size` computes at once, the prompt within it, even, two or more)
    /// and read more than 1.25 times the bytes they touched: what both
    /// hints ask before they say anything.
    fn read_one_prompt_again(&self, size: ContextSize) -> bool {
        let n_ctx = if size.n_ctx == 0 { u64::MAX } else { size.n_ctx };
        let one_prompt = self.ubatch >= size.n_ubatch && self.tokens <= n_ctx && !self.uneven && self.steps >= 2;
        one_prompt && self.bytes_read as f64 > 1.25 * self.touched_bytes as f64
    }

    /// The `-b` that would give the whole prompt to one `llama_decode`, whose
    /// ubatches are computed together and so read each expert once (where
    /// the arena holds a layer's experts): the prompt rounded up to the
    /// context's ubatch, within the context, and within what one group can
    /// hold (`group_capacity` ubatches; 0 if unknown): a larger batch is
    /// cut into groups that each read the experts again. None if the run
    /// read its experts about once already, its steps cannot be one
    /// prompt's batches (see `ubatch_hint`), or no larger batch would be
    /// one group.
    pub fn batch_hint(&self, size: ContextSize, group_capacity: u32) -> Option<u64> {
        let known = |n: u64| if n == 0 { u64::MAX } else { n };
        if !self.read_one_prompt_again(size) || group_capacity == 1 {
            return None;
        }
        let ubatch = size.n_ubatch.max(1);
        let batch = (self.tokens.div_ceil(ubatch) * ubatch).min(known(u64::from(group_capacity)).saturating_mul(ubatch));
        Some(batch.min(known(size.n_ctx))).filter(|&b| b > self.ubatch)
    }
}

impl PhaseClock {
    /// The ubatch about to be computed starts at position `pos0` of its
    /// sequence (told before its step starts).
    pub fn ubatch_begins(&mut self, pos0: i32) {
        self.next_starts_sequence = pos0 == 0;
    }

    /// A step of `tokens` tokens starts at `now`, with the pager's totals so
    /// far `pager`; the step before it is closed. A decode step ends the
    /// prompt run, and so does a prompt step that starts its sequence
    /// (another prompt: llama-bench runs one several times over); the run
    /// is returned if it had two or more ubatches.
    pub fn step_started(&mut self, tokens: u64, pager: PagerTotals, now: Instant) -> Option<PromptRun> {
        self.close(pager, now);
        self.open = Some(Open { decode: tokens == 1, tokens, started: now, at_start: pager, ended: None });
        let starts_sequence = std::mem::take(&mut self.next_starts_sequence);
        if tokens > 1 {
            let ended = if starts_sequence { self.end_run(pager) } else { None };
            let run = self.run.get_or_insert_with(|| PromptRun { bytes_at_start: pager.bytes_read, ..PromptRun::default() });
            run.uneven |= run.steps > 0 && (run.last < run.ubatch || tokens > run.ubatch);
            run.steps += 1;
            run.tokens += tokens;
            run.ubatch = run.ubatch.max(tokens);
            run.last = tokens;
            ended
        } else {
            self.end_run(pager)
        }
    }

    /// A prompt step's layer used `experts` of `expert_bytes` each.
    pub fn touched(&mut self, layer: u32, experts: &[u32], expert_bytes: u64) {
        if let (Some(run), Some(Open { decode: false, .. })) = (&mut self.run, &self.open) {
            for &e in experts {
                if run.touched.insert(ExpertKey::new(layer, e)) {
                    run.touched_bytes += expert_bytes;
                    self.prompt.touched_bytes += expert_bytes;
                }
            }
        }
    }

    /// The prompt being computed so far: its tokens, the bytes read since
    /// it started (`pager` now) and its touched experts' bytes; zeros
    /// between prompts.
    pub fn prompt_so_far(&self, pager: PagerTotals) -> (u64, u64, u64) {
        self.run.as_ref().map_or((0, 0, 0), |r| (r.tokens, pager.bytes_read.saturating_sub(r.bytes_at_start), r.touched_bytes))
    }

    /// Ends the prompt run (at a decode step, or at exit): returned if it
    /// had two or more ubatches.
    pub fn end_run(&mut self, pager: PagerTotals) -> Option<PromptRun> {
        let mut run = self.run.take().filter(|r| r.steps >= 2)?;
        run.bytes_read = pager.bytes_read.saturating_sub(run.bytes_at_start);
        Some(run)
    }

    /// The open step's last paged layer finished at `now`.
    pub fn step_ended(&mut self, now: Instant) {
        if let Some(open) = &mut self.open {
            open.ended = Some(now);
        }
    }

    /// Closes the open step (at exit: at its last paged layer, or `now`).
    pub fn close(&mut self, pager: PagerTotals, now: Instant) {
        let Some(open) = self.open.take() else { return };
        let end = match open.ended {
            Some(ended) if now.saturating_duration_since(ended) > IDLE => ended,
            _ => now,
        };
        let t = if open.decode { &mut self.decode } else { &mut self.prompt };
        t.steps += 1;
        t.tokens += open.tokens;
        t.bytes_read += pager.bytes_read.saturating_sub(open.at_start.bytes_read);
        t.hits += pager.hits.saturating_sub(open.at_start.hits);
        t.misses += pager.misses.saturating_sub(open.at_start.misses);
        t.prefetch_used += pager.prefetch_used.saturating_sub(open.at_start.prefetch_used);
        t.waited_us += pager.waited_us.saturating_sub(open.at_start.waited_us);
        t.seconds += end.saturating_duration_since(open.started).as_secs_f64();
    }

    /// The totals with the open step counted as if it closed at `now`.
    pub fn totals(&self, pager: PagerTotals, now: Instant) -> (PhaseTotals, PhaseTotals) {
        let mut c = PhaseClock { open: self.open, prompt: self.prompt, decode: self.decode, run: None, next_starts_sequence: false };
        c.close(pager, now);
        (c.prompt, c.decode)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steps_are_summed_by_phase_and_idle_gaps_left_out() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let p = |bytes_read, hits, misses| PagerTotals { bytes_read, hits, misses, prefetch_used: hits / 2, waited_us: misses * 10 };
        let mut c = PhaseClock::default();
        c.step_started(512, p(0, 0, 0), at(0)); // a prompt ubatch
        c.step_ended(at(900));
        c.step_started(1, p(1000, 5, 10), at(1000)); // decode: the prompt took 1 s
        c.step_ended(at(1100));
        c.step_started(1, p(1500, 9, 11), at(1200));
        c.step_ended(at(1300));
        // Then the server waits 5 s for its next request.
        c.step_started(7, p(1600, 12, 12), at(6300));
        let (prompt, decode) = c.totals(p(1700, 13, 14), at(6400));
        assert_eq!((prompt.steps, prompt.tokens, prompt.bytes_read, prompt.hits, prompt.misses), (2, 519, 1100, 6, 12));
        assert_eq!((decode.hits, decode.misses, decode.prefetch_used), (7, 2, 4));
        assert_eq!((prompt.waited_us, decode.waited_us), (120, 20));
        assert!((prompt.seconds - 1.1).abs() < 1e-9, "{prompt:?}");
        assert_eq!((decode.steps, decode.tokens, decode.bytes_read), (2, 2, 600));
        // 0.2 s for the first decode step, 0.1 s (to its last layer) for the second.
        assert!((decode.seconds - 0.3).abs() < 1e-9, "{decode:?}");
    }

    #[test]
    fn the_prompt_so_far_is_its_own_and_ends_with_it() {
        let p = |bytes_read| PagerTotals { bytes_read, ..PagerTotals::default() };
        let now = Instant::now();
        let mut c = PhaseClock::default();
        c.step_started(1, p(100), now); // a decode step before: not the prompt's
        assert_eq!(c.prompt_so_far(p(100)), (0, 0, 0));
        c.ubatch_begins(10);
        c.step_started(512, p(100), now);
        c.touched(3, &[1, 2], 50);
        c.step_started(300, p(400), now);
        c.touched(3, &[2, 5], 50);
        assert_eq!(c.prompt_so_far(p(700)), (812, 600, 150));
        c.step_started(1, p(700), now);
        assert_eq!(c.prompt_so_far(p(700)), (0, 0, 0));
    }

    #[test]
    fn a_prompt_of_several_batches_gets_a_batch_of_the_whole_prompt() {
        // 8,000 tokens in four llama_decode batches of 2,048 (each a group
        // of ubatches of 512), each reading the same 800 bytes again.
        let run = PromptRun { steps: 4, tokens: 8000, ubatch: 2048, bytes_read: 3200, touched_bytes: 800, ..PromptRun::default() };
        assert_eq!(run.batch_hint(ContextSize { n_ctx: 8192, n_ubatch: 512 }, 0), Some(8192));
        // Within the context: llama.cpp cuts -b to it.
        let tight = PromptRun { tokens: 7900, ..run.clone() };
        assert_eq!(tight.batch_hint(ContextSize { n_ctx: 7936, n_ubatch: 512 }, 0), Some(7936));
        // A run that read its experts about once, or one batch, gets none.
        assert_eq!(PromptRun { bytes_read: 900, ..run.clone() }.batch_hint(ContextSize { n_ctx: 8192, n_ubatch: 512 }, 0), None);
        assert_eq!(PromptRun { steps: 1, ..run.clone() }.batch_hint(ContextSize { n_ctx: 8192, n_ubatch: 512 }, 0), None);
        // Steps smaller than the context's ubatch are batches of their own.
        assert_eq!(PromptRun { ubatch: 16, tokens: 64, ..run.clone() }.batch_hint(ContextSize { n_ctx: 8192, n_ubatch: 512 }, 0), None);
        // A group holds 8 ubatches: -b 4096 reads the prompt twice, not
        // four times. Where it holds the 4 ubatches of the batch given, no
        // larger batch is one group; where it holds none, nothing is.
        let size = ContextSize { n_ctx: 8192, n_ubatch: 512 };
        assert_eq!(run.batch_hint(size, 8), Some(4096));
        assert_eq!((run.batch_hint(size, 4), run.batch_hint(size, 1)), (None, None));
        assert_eq!(run.batch_hint(size, 100), Some(8192));
    }

    #[test]
    fn a_prompt_that_read_its_experts_once_per_ubatch_gets_a_larger_ubatch() {
        let p = |bytes_read| PagerTotals { bytes_read, ..PagerTotals::default() };
        let now = Instant::now();
        let mut c = PhaseClock::default();
        // 2,000 tokens in four ubatches of 512, each touching and reading the
        // same 8 experts of 100 bytes: 3,200 read, 800 touched.
        for (i, tokens) in [512, 512, 512, 464].into_iter().enumerate() {
            c.ubatch_begins(i as i32 * 512);
            c.step_started(tokens, p(i as u64 * 800), now);
            c.touched(0, &[0, 1, 2, 3, 4, 5, 6, 7], 100);
        }
        let run = c.step_started(1, p(3200), now).expect("four ubatches");
        assert_eq!((run.steps, run.tokens, run.ubatch, run.bytes_read, run.touched_bytes), (4, 2000, 512, 3200, 800));
        // Compute buffers of 100 B at 512: 2,048 needs 300 B more, which the
        // arena gives up and its one ubatch may read again.
        let h = run.ubatch_hint(100, 400, ContextSize { n_ctx: 4096, n_ubatch: 512 }).unwrap();
        assert_eq!((h.ubatch, h.reads, h.extra), (2048, 1100, 300));
        // With room for 1,024 only: two ubatches of 800 + 100.
        let h = run.ubatch_hint(100, 150, ContextSize::default()).unwrap();
        assert_eq!((h.ubatch, h.reads), (1024, 1800));
        assert_eq!(run.ubatch_hint(100, 50, ContextSize::default()), None, "no room for a larger ubatch");
        // Buffers so large that what the arena gives up outweighs the saving.
        assert_eq!(run.ubatch_hint(2_000, u64::MAX, ContextSize::default()), None);
        // A run that read each expert about once has nothing to gain.
        let once = PromptRun { steps: 4, tokens: 2000, ubatch: 512, bytes_read: 900, touched_bytes: 800, ..PromptRun::default() };
        assert_eq!(once.ubatch_hint(0, u64::MAX, ContextSize::default()), None);
        // One ubatch is no run.
        c.step_started(300, p(0), now);
        assert!(c.step_started(1, p(10), now).is_none());
        // Verification batches of drafts back to back are no prompt's
        // ubatches, however much they read.
        for (i, tokens) in [9, 4, 9, 6].into_iter().enumerate() {
            c.step_started(tokens, p(i as u64 * 800), now);
            c.touched(0, &[0, 1], 100);
        }
        let run = c.step_started(1, p(3200), now).expect("four steps");
        assert_eq!(run.ubatch_hint(0, u64::MAX, ContextSize::default()), None, "{run:?}");
        // A short prompt computed twice from its start (llama-bench's
        // warm-up and repetition): two prompts of one ubatch, no run.
        for (i, tokens) in [16, 16].into_iter().enumerate() {
            c.ubatch_begins(0);
            c.step_started(tokens, p(i as u64 * 800), now);
            c.touched(0, &[0, 1], 100);
        }
        assert!(c.step_started(1, p(1600), now).is_none());
        // Two prompts of two ubatches each, back to back: the first ends as
        // the second starts, and is one prompt's run.
        for (i, (pos0, tokens)) in [(0, 16), (16, 16), (0, 16), (16, 16)].into_iter().enumerate() {
            c.ubatch_begins(pos0);
            let ended = c.step_started(tokens, p(i as u64 * 400), now);
            assert_eq!(ended.map(|r| (r.steps, r.tokens, r.bytes_read)), (i == 2).then_some((2, 32, 800)), "step {i}");
        }
        assert_eq!(c.step_started(1, p(1600), now).map(|r| (r.steps, r.tokens)), Some((2, 32)));
        // Told no positions, steps of 16 in a context whose ubatch is 512
        // are batches of their own, which a larger -ub would not join.
        for (i, tokens) in [16, 16].into_iter().enumerate() {
            c.step_started(tokens, p(i as u64 * 800), now);
            c.touched(0, &[0, 1], 100);
        }
        let run = c.step_started(1, p(1600), now).expect("two steps");
        let size = |n_ctx, n_ubatch| ContextSize { n_ctx, n_ubatch };
        assert_eq!(run.ubatch_hint(0, u64::MAX, size(4096, 512)), None, "{run:?}");
        // Nor in a context of 20 with a ubatch of 16: 32 tokens do not fit.
        assert_eq!(run.ubatch_hint(0, u64::MAX, size(20, 16)), None, "{run:?}");
        // A context that holds them: one prompt's ubatches of 16, joined in
        // one ubatch of the prompt (not one of 256, larger than the context).
        let h = run.ubatch_hint(0, u64::MAX, size(48, 16)).expect("ubatches of a -ub 16 context");
        assert_eq!(h.ubatch, 32, "{h:?}");
    }
}
