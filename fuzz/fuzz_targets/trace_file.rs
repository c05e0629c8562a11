//! A routing trace as `sdq replay` reads it (trace.rs), and, when it reads,
//! its replay at a few arena sizes through every policy and the Bélády
//! bound, which checks that no policy beats the bound.
#![no_main]

use libfuzzer_sys::fuzz_target;
use sdq::engine::pager::PolicyKind;

fuzz_target!(|data: &[u8]| {
    let Ok(trace) = sdq::engine::routing::trace::Trace::read(std::path::Path::new("fuzz.csv"), data) else { return };
    assert!(!trace.batches.is_empty() && trace.top_k > 0);
    // Keep each input fast: replay cost grows with lookups × slots.
    let lookups: usize = trace.batches.iter().map(|b| b.experts.len()).sum();
    if lookups > 5_000 || trace.layers.len() > 64 {
        return;
    }
    let layout = sdq::commands::replay::layout_of(&trace);
    let min = layout.min_arena_bytes(trace.top_k);
    let cycle = layout.token_cycle_bytes(trace.top_k);
    for arena in [min, cycle, cycle.saturating_mul(4)] {
        if let Ok(o) = sdq::commands::replay::run(&trace, arena, &PolicyKind::ALL) {
            for (_, t) in &o.policies {
                assert_eq!(t.hits + t.misses, lookups as u64);
            }
        }
    }
});
