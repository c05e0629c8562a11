//! Whether reading ahead pays: the next layer's predicted experts are worth
//! reading only while the prediction is mostly right. A prefetched expert
//! the token does not use costs a read and evicts one it may use. Measured
//! (docs/BENCHMARKS.md): on the 35B-A3B's skewed routing 95 % of prefetched
//! experts were used and prefetching sped decode up 1.16-1.58×; on
//! gpt-oss-120b with routing that looks trained about 75 % were, and it read
//! a third more bytes a token for the same speed.

/// Prefetched experts per judgement of the precision. Large beside one
/// layer's top-k, because a prefetch is counted used only when the next
/// layer runs, so the latest ones are not judged yet.
pub const WINDOW: u64 = 256;

/// The share of prefetched experts used, below which prefetching stops.
pub const MIN_PRECISION: f64 = 0.85;

/// While stopped, one prefetch in this many still runs, so the precision
/// keeps being measured and prefetching resumes when routing changes.
pub const PROBE_EVERY: u64 = 8;

/// The running judgement: open until a window's precision falls short.
#[derive(Debug)]
pub struct PrefetchGate {
    /// The totals (prefetched, used) when the current window started.
    base: (u64, u64),
    open: bool,
    calls: u64,
}

impl Default for PrefetchGate {
    fn default() -> Self {
        PrefetchGate { base: (0, 0), open: true, calls: 0 }
    }
}

impl PrefetchGate {
    /// Given the pager's totals so far (experts prefetched, prefetched
    /// experts used), whether this layer's prefetch should run.
    pub fn admit(&mut self, prefetched: u64, used: u64) -> bool {
        let n = prefetched.saturating_sub(self.base.0);
        if n >= WINDOW {
            let precision = used.saturating_sub(self.base.1) as f64 / n as f64;
            if self.open != (precision >= MIN_PRECISION) {
                log::info!("prefetch {}: {:.0} % of the last {n} prefetched experts were used", if self.open { "stops" } else { "resumes" }, 100.0 * precision);
            }
            self.open = precision >= MIN_PRECISION;
            self.base = (prefetched, used);
        }
        self.calls += 1;
        self.open || self.calls % PROBE_EVERY == 0
    }

    pub fn is_open(&self) -> bool {
        self.open
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stops_below_the_precision_probes_and_resumes() {
        let mut g = PrefetchGate::default();
        // Open until a whole window is judged.
        assert!((0..100).all(|_| g.admit(WINDOW - 1, 0)));
        // A window with 75 % used: closed, but one call in PROBE_EVERY runs.
        let used = WINDOW * 3 / 4;
        let admitted = (0..64).filter(|_| g.admit(WINDOW, used)).count();
        assert!(!g.is_open());
        assert_eq!(admitted as u64, 64 / PROBE_EVERY);
        // The next window is 95 % used: open again.
        assert!(g.admit(2 * WINDOW, used + WINDOW * 95 / 100));
        assert!(g.is_open());
    }
}
