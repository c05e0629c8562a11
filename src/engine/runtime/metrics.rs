//! The pager's figures as llama-server shows them: Prometheus text for
//! `/metrics` and an object for `/props`, both read from the same figures
//! the stats file holds, so the three never disagree; and the prompt being
//! computed, beside the server's own progress on it.

use serde_json::{json, Value};
use std::fmt::Write;

/// A reporting format of the `report` hook (`SDQ_REPORT_*` in the C header).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Report {
    Prometheus,
    Props,
    /// The prompt being computed (a streamed prompt's `prompt_progress`).
    Prompt,
    /// A prompt not begun (its first progress event): zeros, where the
    /// figures so far would still be the last prompt's.
    PromptNone,
}

impl Report {
    pub fn from_c(kind: i32) -> Option<Report> {
        match kind {
            0 => Some(Report::Prometheus),
            1 => Some(Report::Props),
            2 => Some(Report::Prompt),
            3 => Some(Report::PromptNone),
            _ => None,
        }
    }
}

/// Counters: (metric name, help, the stats file's key).
const COUNTERS: &[(&str, &str, &str)] = &[
    ("sdq_expert_hits_total", "Expert lookups found in the arena", "hits"),
    ("sdq_expert_misses_total", "Expert lookups that had to read the expert from the file", "misses"),
    ("sdq_expert_rereads_total", "Misses on an expert the arena had held and evicted", "rereads"),
    ("sdq_experts_prefetched_total", "Experts read ahead of their layer", "prefetched"),
    ("sdq_reads_total", "Expert reads from the file", "reads"),
    ("sdq_read_bytes_total", "Bytes of routed experts read from the file", "bytes_read"),
    ("sdq_device_read_bytes_total", "Bytes the reads asked of the device (aligned for direct I/O)", "device_bytes_read"),
    ("sdq_read_seconds_total", "Wall time of the reads, summed over the readers", "read_seconds"),
    ("sdq_read_wait_seconds_total", "Time compute threads waited for an expert to be read, summed over the threads", "read_wait_seconds"),
    ("sdq_read_retries_total", "Reads repeated after a transient error", "read_retries"),
    ("sdq_read_failures_total", "Expert reads that failed after their retries (each failed its batch)", "read_failures"),
    ("sdq_arena_shrinks_total", "Times the arena gave memory back under pressure", "arena_shrinks"),
    ("sdq_arena_grows_total", "Times the arena grew back when room returned", "arena_grows"),
    ("sdq_prompt_tokens_total", "Prompt tokens computed under the budget", "prompt.tokens"),
    ("sdq_prompt_read_bytes_total", "Bytes of routed experts read while computing prompts", "prompt.bytes_read"),
    ("sdq_prompt_touched_bytes_total", "Bytes of the distinct routed experts each prompt used, summed over prompts (each read once)", "prompt.touched_bytes"),
    ("sdq_prompt_groups_total", "Prompt batches whose ubatches were computed together, layer by layer", "prompt_groups.groups"),
];

/// Gauges: (metric name, help, the stats file's key).
const GAUGES: &[(&str, &str, &str)] = &[
    ("sdq_budget_bytes", "The RAM budget (--ram-budget)", "budget_bytes"),
    ("sdq_arena_bytes", "The expert arena's size now", "arena_bytes"),
    ("sdq_arena_planned_bytes", "The expert arena's planned size", "arena_planned_bytes"),
    ("sdq_arena_filled_bytes", "Arena bytes holding an expert", "arena_filled_bytes"),
    ("sdq_expert_file_bytes", "Routed-expert bytes in the model's file", "expert_bytes_total"),
    ("sdq_peak_rss_anon_bytes", "Peak anonymous resident memory of the process", "peak_rss_anon_bytes"),
    ("sdq_swap_bytes", "Swap the process used (largest seen)", "vm_swap_bytes"),
];

/// The figures of `stats` (the stats file's object) in `report`'s format
/// (not `Report::Prompt`, which is `prompt_so_far`).
pub fn render(report: Report, stats: &Value) -> String {
    match report {
        Report::Prometheus => prometheus(stats),
        Report::Props => props(stats).to_string(),
        Report::Prompt | Report::PromptNone => prompt_so_far(0, 0, 0),
    }
}

/// The prompt being computed: its tokens so far, the expert bytes read for
/// it and the bytes of the distinct experts it used (each read once).
pub fn prompt_so_far(tokens: u64, read_bytes: u64, touched_bytes: u64) -> String {
    json!({ "tokens": tokens, "read_bytes": read_bytes, "touched_bytes": touched_bytes }).to_string()
}

fn prometheus(stats: &Value) -> String {
    let mut out = String::new();
    let mut emit = |kind: &str, (name, help, key): &(&str, &str, &str)| {
        // A dotted key names a figure inside an object ("prompt.tokens").
        if let Some(v) = key.split('.').try_fold(stats, |v, k| v.get(k)).and_then(Value::as_f64) {
            // Writing into a String cannot fail.
            let _ = write!(out, "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}\n");
        }
    };
    COUNTERS.iter().for_each(|m| emit("counter", m));
    GAUGES.iter().for_each(|m| emit("gauge", m));
    let paged = stats.get("paged").and_then(Value::as_bool).unwrap_or(false);
    let _ = write!(
        out,
        "# HELP sdq_paged Whether routed experts are paged (1) or the model has none in use (0)\n# TYPE sdq_paged gauge\nsdq_paged {}\n",
        u8::from(paged)
    );
    out
}

fn props(stats: &Value) -> Value {
    let pick = |key: &str| stats.get(key).cloned().unwrap_or(Value::Null);
    json!({
        "budget_bytes": pick("budget_bytes"),
        "paged": pick("paged"),
        "arena_bytes": pick("arena_bytes"),
        "arena_planned_bytes": pick("arena_planned_bytes"),
        "arena_pages": pick("arena_pages"),
        "expert_bytes_total": pick("expert_bytes_total"),
        "top_k": pick("top_k"),
        "slot_classes": pick("slot_classes"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_prompt_so_far_is_an_object_of_its_three_figures() {
        assert_eq!(Report::from_c(2), Some(Report::Prompt));
        assert_eq!(Report::from_c(3), Some(Report::PromptNone));
        assert_eq!(Report::from_c(4), None);
        let v: Value = serde_json::from_str(&prompt_so_far(2048, 7 << 20, 5 << 20)).unwrap();
        assert_eq!(v, json!({ "tokens": 2048, "read_bytes": 7 << 20, "touched_bytes": 5 << 20 }));
    }

    #[test]
    fn prometheus_names_every_figure_once_with_its_type() {
        let stats = json!({ "hits": 7, "misses": 3, "bytes_read": 4096, "budget_bytes": 1u64 << 30, "arena_bytes": 512, "paged": true, "prompt": { "bytes_read": 300 } });
        let text = render(Report::Prometheus, &stats);
        assert!(text.contains("# TYPE sdq_expert_hits_total counter\nsdq_expert_hits_total 7\n"), "{text}");
        assert!(text.contains("# TYPE sdq_arena_bytes gauge\nsdq_arena_bytes 512\n"), "{text}");
        assert!(text.contains("sdq_budget_bytes 1073741824\n"), "{text}");
        assert!(text.contains("# TYPE sdq_prompt_read_bytes_total counter\nsdq_prompt_read_bytes_total 300\n"), "{text}");
        assert!(text.ends_with("sdq_paged 1\n"), "{text}");
        // A figure the stats lack (no read ever failed to be counted yet) is left out, not zeroed.
        assert!(!text.contains("sdq_read_failures_total"), "{text}");
        let props: Value = serde_json::from_str(&render(Report::Props, &stats)).unwrap();
        assert_eq!(props["arena_bytes"], 512);
        assert_eq!(props["budget_bytes"], 1u64 << 30);
    }
}
