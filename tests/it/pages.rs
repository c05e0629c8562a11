//! The arena's pages: 2 MiB transparent huge pages where the system offers
//! them, 4 KiB pages otherwise, and the same tokens either way.

use crate::util::*;
use sdq::engine::pager::arena::thp_mode;
use std::process::Command;

const THP: &str = "/sys/kernel/mm/transparent_hugepage/enabled";

/// One greedy run of the wide model under a budget with the arena faulted in
/// first: (stdout, stderr, stats).
fn run_paged(env: &[(&str, &str)], name: &str) -> (String, String, serde_json::Value) {
    let stats = scratch().join(format!("pages-{name}.json"));
    let o = run(
        Command::new(bin("llama-completion"))
            .args(completion_args(wide(), "The river by the lamp", 16))
            .args(["--ram-budget", "1G", "--sdq-stats", stats.to_str().unwrap()])
            .env("SDQ_POPULATE", "1")
            .envs(env.iter().copied()),
        300,
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let s = read_json(&stats);
    (stdout(&o), stderr(&o), s)
}

#[test]
fn the_arena_takes_huge_pages_where_offered_and_answers_as_on_4k_pages() {
    let (huge, err, s) = run_paged(&[], "auto"); // the default: huge pages where offered
    let (small, _, s4) = run_paged(&[("SDQ_HUGEPAGES", "0")], "4k");
    let (stock, _) = {
        let o = run(Command::new(bin("llama-completion")).args(completion_args(wide(), "The river by the lamp", 16)), 300);
        assert!(o.status.success(), "{}", stderr(&o));
        (stdout(&o), stderr(&o))
    };
    assert_eq!(huge, stock, "huge pages changed the answer");
    assert_eq!(small, stock, "4 KiB pages changed the answer");
    assert_eq!(s4["arena_pages"], "4 KiB pages", "{s4}");
    assert_eq!(u(&s4, "arena_huge_bytes"), 0, "{s4}");
    if matches!(thp_mode().as_deref(), Some("always" | "madvise")) {
        assert_eq!(s["arena_pages"], "2 MiB transparent huge pages", "{s}");
        // Populated at start: the kernel gives huge pages where it finds
        // (or compacts) free 2 MiB; on this project's machines most of it.
        assert!(u(&s, "arena_huge_bytes") > 0, "{s}");
        assert!(u(&s, "minor_faults") < u(&s4, "minor_faults"), "huge pages should take fewer faults: {} vs {}", s["minor_faults"], s4["minor_faults"]);
        assert!(!err.contains("4 KiB pages"), "{err}");
    }
}

/// Writes `value` back to the kernel setting `path` when dropped (even if
/// the test fails): the tests below change system-wide settings.
struct Restore {
    path: &'static str,
    value: String,
}

impl Drop for Restore {
    fn drop(&mut self) {
        let _ = std::fs::write(self.path, &self.value);
    }
}

#[test]
fn with_huge_pages_off_the_arena_falls_back_to_4k_pages_with_one_notice() {
    let Some(mode) = thp_mode() else {
        eprintln!("no transparent huge pages in this kernel: the fallback is the only path");
        return;
    };
    if std::fs::write(THP, &mode).is_err() {
        eprintln!("{THP} is not writable (not root): cannot switch huge pages off for this test");
        return;
    }
    let _restore = Restore { path: THP, value: mode };
    std::fs::write(THP, "never").unwrap();
    let (answer, err, s) = run_paged(&[("SDQ_HUGEPAGES", "auto")], "never");
    let notices: Vec<&str> = err.lines().filter(|l| l.contains("4 KiB pages")).collect();
    assert_eq!(notices, ["sdq: notice: transparent huge pages are off on this system (never): the expert arena uses 4 KiB pages"], "{err}");
    assert_eq!(s["arena_pages"], "4 KiB pages", "{s}");
    assert_eq!(u(&s, "arena_huge_bytes"), 0, "{s}");
    let o = run(Command::new(bin("llama-completion")).args(completion_args(wide(), "The river by the lamp", 16)), 300);
    assert_eq!(answer, stdout(&o));
}

const NR_HUGEPAGES: &str = "/proc/sys/vm/nr_hugepages";

#[test]
fn explicit_hugetlb_pages_hold_the_arena_and_count_in_the_budget() {
    let Ok(pool) = std::fs::read_to_string(NR_HUGEPAGES) else {
        eprintln!("no hugetlb pool in this kernel");
        return;
    };
    if std::fs::write(NR_HUGEPAGES, pool.trim()).is_err() {
        eprintln!("{NR_HUGEPAGES} is not writable (not root): cannot reserve huge pages for this test");
        return;
    }
    let _restore = Restore { path: NR_HUGEPAGES, value: pool.trim().to_string() };
    // The wide model's arena holds every expert: 260 MiB.
    std::fs::write(NR_HUGEPAGES, "200").unwrap();
    let (answer, err, s) = run_paged(&[("SDQ_HUGEPAGES", "hugetlb")], "hugetlb");
    let stock = stdout(&run(Command::new(bin("llama-completion")).args(completion_args(wide(), "The river by the lamp", 16)), 300));
    assert_eq!(answer, stock, "hugetlb pages changed the answer");
    assert!(!err.contains("sdq: notice"), "{err}");
    assert_eq!(s["arena_pages"], "2 MiB hugetlb pages", "{s}");
    assert!(u(&s, "arena_huge_bytes") >= u(&s, "arena_slot_bytes"), "{s}");
    // hugetlb pages are outside RssAnon; the budget's measure counts them.
    assert!(u(&s, "peak_rss_anon_bytes") > u(&s, "arena_huge_bytes"), "{s}");

    std::fs::write(NR_HUGEPAGES, "0").unwrap();
    let (answer, err, s) = run_paged(&[("SDQ_HUGEPAGES", "hugetlb")], "hugetlb-empty");
    assert_eq!(answer, stock);
    let notices: Vec<&str> = err.lines().filter(|l| l.starts_with("sdq: notice")).collect();
    assert_eq!(notices.len(), 1, "{err}");
    assert!(notices[0].contains("the hugetlb pool cannot hold the arena's 260 MiB") && notices[0].contains("see vm.nr_hugepages"), "{err}");
    assert_ne!(s["arena_pages"], "2 MiB hugetlb pages", "{s}");
}

/// `SDQ_POPULATE=ahead` faults the arena in no further than its window
/// beyond the slots the run has filled: memory a run never fills is never
/// touched, and the answer is stock's.
#[test]
fn populating_ahead_stays_within_its_window_of_the_filled_slots() {
    // One slot class (every expert q8_0), 835 MiB of experts: an arena that
    // holds them all, of which a short run fills a few hundred MiB at most.
    let model = TempModel::generate(
        "ahead.gguf",
        &["--preset", "tiny", "--layers", "4", "--experts", "256", "--top-k", "8", "--expert-ff", "1024", "--expert-type", "q8_0", "--seed", "5"],
    );
    let run_with = |populate: &str| {
        let stats = scratch().join(format!("pages-populate-{populate}.json"));
        let o = run(
            Command::new(bin("llama-completion"))
                .args(completion_args(&model, "The river by the lamp", 4))
                .args(["--ram-budget", "2G", "--sdq-stats", stats.to_str().unwrap()])
                // Preload would fill the whole arena (it holds every expert).
                .env("SDQ_PRELOAD", "0")
                .env("SDQ_POPULATE", populate),
            300,
        );
        assert!(o.status.success(), "{}", stderr(&o));
        let s: serde_json::Value = read_json(&stats);
        (stdout(&o), s)
    };
    let (ahead, s) = run_with("ahead");
    let (now, s1) = run_with("1");
    let stock = stdout(&run(Command::new(bin("llama-completion")).args(completion_args(&model, "The river by the lamp", 4)), 300));
    assert_eq!(ahead, stock, "populating ahead changed the answer");
    assert_eq!(now, stock);
    assert_eq!(s["arena_populate"], "ahead", "{s}");
    assert_eq!(s["slot_classes"].as_array().map(Vec::len), Some(1), "{s}");
    let (arena, filled, resident) = (u(&s, "arena_slot_bytes"), u(&s, "arena_filled_bytes"), u(&s, "arena_resident_bytes"));
    let window = sdq::engine::pager::POPULATE_AHEAD_BYTES as u64;
    assert!(filled > 0 && filled + window < arena, "the run should leave more than the window unfilled: {s}");
    // The window, and a huge page's rounding where the slot ends.
    assert!(resident <= filled + window + (2 << 20), "populated {resident} B with {filled} B filled: {s}");
    // Populating it all (`1`) does fault in the whole arena.
    assert!(u(&s1, "arena_resident_bytes") >= u(&s1, "arena_slot_bytes"), "{s1}");
}
