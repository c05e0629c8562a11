//! What the pager counts: each layer's hits, misses and reads, the whole
//! pager's figures, and the running totals a step is measured between.

/// Counts of one layer. A *use* is one expert needed by one batch: `prepare`
/// counts it as a hit or a miss when the router has chosen. The matmuls of
/// the use then normally find it; if the expert was evicted in
/// between (a batch touching more experts than the arena holds), the read
/// again is a *reread*.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LayerCounts {
    pub hits: u64,
    pub misses: u64,
    pub rereads: u64,
    /// Experts `prefetch` started reading for this layer.
    pub prefetched: u64,
    /// Uses (counted as hits) that found a prefetched expert; `prefetch_late`
    /// of them found it still being read.
    pub prefetch_used: u64,
    pub prefetch_late: u64,
    /// Prefetched experts evicted before any batch used them.
    pub prefetch_wasted: u64,
    /// A decode step's predicted experts for this layer that the arena did
    /// not hold, read ahead or not: used by the layer's next batch (held),
    /// or not. Their share is what the gate judges prefetching by.
    pub prediction_held: u64,
    pub prediction_missed: u64,
    /// Experts `preload` started reading (not counted in `prefetched`; a
    /// use that finds one counts in `prefetch_used`).
    pub preloaded: u64,
    /// Microseconds the layer's compute threads spent waiting for an expert
    /// (its read, or a slot to read it into), summed over threads: the
    /// reads not hidden behind compute.
    pub waited_us: u64,
}

/// Figures the pager has gathered so far.
#[derive(Clone, Debug, Default)]
pub struct PagerCounts {
    pub per_layer: Vec<(u32, LayerCounts)>,
    pub bytes_read: u64,
    pub device_bytes: u64,
    pub read_seconds: f64,
    pub reads: u64,
    /// Expert parts converted into a repacked layout after their read, and
    /// the CPU time (not wall time) the readers spent on it.
    pub converted: u64,
    pub convert_seconds: f64,
    /// Batches of misses read in parallel (`prepare`), their bytes, and their
    /// wall time from submission to the last byte.
    pub miss_batches: u64,
    pub miss_batch_bytes: u64,
    pub miss_batch_seconds: f64,
    /// Experts a warm start has read (also counted as preloaded), and those
    /// it has yet to consider (an expert already held is not read again).
    pub warm_read: u64,
    pub warm_pending: u64,
    /// Tries repeated after a transient read error, and expert reads that
    /// failed even so.
    pub read_retries: u64,
    pub read_failures: u64,
}

/// The pager's running totals, read at a step's start and end.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PagerTotals {
    pub bytes_read: u64,
    pub hits: u64,
    pub misses: u64,
    pub prefetch_used: u64,
    /// Microseconds compute threads waited for reads, summed over threads.
    pub waited_us: u64,
}

impl std::ops::Add for PagerTotals {
    type Output = PagerTotals;

    fn add(self, o: PagerTotals) -> PagerTotals {
        PagerTotals {
            bytes_read: self.bytes_read + o.bytes_read,
            hits: self.hits + o.hits,
            misses: self.misses + o.misses,
            prefetch_used: self.prefetch_used + o.prefetch_used,
            waited_us: self.waited_us + o.waited_us,
        }
    }
}
