//! Whether reading ahead pays: the next layer's predicted experts are worth
//! reading only while the prediction is mostly right. A prefetched expert
//! the token does not use costs a read and evicts one it may use. Measured
//! (docs/BENCHMARKS.md): on the 35B-A3B's skewed routing 95 % of prefetched
//! experts were used and prefetching sped decode up 1.16-1.58×; on
//! gpt-oss-120b with routing that looks trained about 75 % were, and it read
//! a third more bytes a token for the same speed; on DeepSeek-V3 at 19
//! layers and 12 GiB (3.4 token cycles) about half, and the 16 tokens
//! after a prompt read 23 % more a token and ran 17 % slower than with it
//! off.

/// Predicted experts per judgement of the precision. Every prediction is
/// judged when its layer's batch runs, read ahead or not (`Pager::predicted`),
/// so a window holds no open prediction and need only tell 75 % from 85 %
/// (a standard error of 5 points at 64): a decode judges its first window
/// within a token or two.
pub const WINDOW: u64 = 64;

/// The share of predicted experts used, below which prefetching stops.
pub const MIN_PRECISION: f64 = 0.85;

/// The running judgement: open until a window's precision falls short, and
/// open again when one reaches it.
#[derive(Debug)]
pub struct PrefetchGate {
    /// The totals (judged, held) when the current window started.
    base: (u64, u64),
    open: bool,
}

impl Default for PrefetchGate {
    fn default() -> Self {
        PrefetchGate { base: (0, 0), open: true }
    }
}

impl PrefetchGate {
    /// Given the pager's totals so far (predicted experts judged, and of
    /// them used), whether this layer's prefetch should run.
    pub fn admit(&mut self, judged: u64, held: u64) -> bool {
        let n = judged.saturating_sub(self.base.0);
        if n >= WINDOW {
            let precision = held.saturating_sub(self.base.1) as f64 / n as f64;
            if self.open != (precision >= MIN_PRECISION) {
                log::info!("prefetch {}: {:.0} % of the last {n} predicted experts were used", if self.open { "stops" } else { "resumes" }, 100.0 * precision);
            }
            self.open = precision >= MIN_PRECISION;
            self.base = (judged, held);
        }
        self.open
    }

    pub fn is_open(&self) -> bool {
        self.open
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stops_below_the_precision_and_resumes_above_it() {
        let mut g = PrefetchGate::default();
        // Open until a whole window is judged.
        assert!((0..100).all(|_| g.admit(WINDOW - 1, 0)));
        // A window with 75 % used: closed, while nothing new is judged.
        assert!(!g.admit(WINDOW, WINDOW * 3 / 4));
        assert!((0..64).all(|_| !g.admit(WINDOW + 1, WINDOW * 3 / 4 + 1)));
        assert!(!g.is_open());
        // The next window is 95 % used: open again.
        assert!(g.admit(2 * WINDOW, WINDOW * 3 / 4 + WINDOW * 95 / 100));
        assert!(g.is_open());
    }
}
