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
}

/// The pager's running totals, read at a step's start and end.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PagerTotals {
    pub bytes_read: u64,
    pub hits: u64,
    pub misses: u64,
    pub prefetch_used: u64,
}

impl PhaseTotals {
    pub fn to_json(&self) -> serde_json::Value {
        const MIB: f64 = crate::budget::MIB as f64;
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
}

impl PhaseClock {
    /// A step of `tokens` tokens starts at `now`, with the pager's totals so
    /// far `pager`; the step before it is closed.
    pub fn step_started(&mut self, tokens: u64, pager: PagerTotals, now: Instant) {
        self.close(pager, now);
        self.open = Some(Open { decode: tokens == 1, tokens, started: now, at_start: pager, ended: None });
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
        t.seconds += end.saturating_duration_since(open.started).as_secs_f64();
    }

    /// The totals with the open step counted as if it closed at `now`.
    pub fn totals(&self, pager: PagerTotals, now: Instant) -> (PhaseTotals, PhaseTotals) {
        let mut c = PhaseClock { open: self.open, prompt: self.prompt, decode: self.decode };
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
        let p = |bytes_read, hits, misses| PagerTotals { bytes_read, hits, misses, prefetch_used: hits / 2 };
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
        assert!((prompt.seconds - 1.1).abs() < 1e-9, "{prompt:?}");
        assert_eq!((decode.steps, decode.tokens, decode.bytes_read), (2, 2, 600));
        // 0.2 s for the first decode step, 0.1 s (to its last layer) for the second.
        assert!((decode.seconds - 0.3).abs() < 1e-9, "{decode:?}");
    }
}
