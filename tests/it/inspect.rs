//! `sdq inspect` reports what the file holds, checked against figures computed
//! here from the tiny preset's geometry.

use crate::util::*;
use serde_json::Value;
use std::process::Command;

#[test]
fn inspect_accounts_for_the_tiny_model() {
    let o = run(Command::new(bin("sdq")).args(["inspect", "--json", "--ram-budget", "1G"]).arg(tiny()), 60);
    assert!(o.status.success(), "{}", stderr(&o));
    let r: Value = serde_json::from_str(&stdout(&o)).unwrap();
    // tiny: n_embd 256, expert FFN 256, 16 experts top-4, 8 layers; down Q6_K
    // on layers 0, 3, 6, 7 (use_more_bits), Q4_K elsewhere; gate/up Q4_K.
    // A 256-wide row is one block: 144 B in Q4_K, 210 B in Q6_K.
    let (q4k_row, q6k_row) = (144, 210);
    let small = 3 * 256 * q4k_row; // gate + up + Q4_K down
    let large = 2 * 256 * q4k_row + 256 * q6k_row;
    assert_eq!((small, large), (110_592, 127_488));
    assert_eq!(r["routed_expert_bytes"], 16 * (4 * small + 4 * large));
    assert_eq!(r["top_k"], 4);
    let classes = r["slot_classes"].as_array().unwrap();
    assert_eq!(classes.len(), 2);
    assert_eq!((&classes[0]["expert_bytes"], &classes[0]["layers"]), (&small.into(), &4.into()));
    assert_eq!((&classes[1]["expert_bytes"], &classes[1]["layers"]), (&large.into(), &4.into()));
    for l in r["layers"].as_array().unwrap() {
        let il = l["layer"].as_u64().unwrap();
        let q6 = [0, 3, 6, 7].contains(&il);
        assert_eq!(l["down"], if q6 { "q6_K" } else { "q4_K" }, "layer {il}");
        assert_eq!(l["bytes_per_expert"], if q6 { large } else { small }, "layer {il}");
    }
    let w = &r["token_working_set"];
    assert_eq!(w["token_read_bytes"], 4 * (4 * small + 4 * large));
    assert_eq!(w["per_layer_max_bytes"], 4 * large);
    // Everything that is not a routed expert is resident; together with the
    // header they make up the file.
    let file = r["file_bytes"].as_u64().unwrap();
    let resident = r["resident_bytes"].as_u64().unwrap();
    let routed = r["routed_expert_bytes"].as_u64().unwrap();
    assert!(resident + routed < file && file - resident - routed < 8 << 20, "header of {} bytes?", file - resident - routed);
    // The budget's split: a reserve of 128 MiB (1 GiB / 16, raised to the floor), slots per class.
    let b = &r["budget"];
    assert_eq!(b["reserve_bytes"], 128u64 << 20);
    assert!(b["slots"].as_array().unwrap().iter().all(|s| s["slots"] == 64), "1 GiB holds every expert: {b}");
    // The text report carries the same figures.
    let t = run(Command::new(bin("sdq")).args(["inspect"]).arg(tiny()), 60);
    let text = stdout(&t);
    assert!(text.contains(&routed.to_string()) && text.contains("class 1: 127488 B per expert"), "{text}");
}

#[test]
fn inspect_rejects_what_is_not_a_model() {
    let bad = scratch().join("not-a-model.gguf");
    std::fs::write(&bad, b"GGUF\x03\x00\x00\x00garbage").unwrap();
    for path in [bad.as_path(), std::path::Path::new("/nonexistent.gguf"), scratch().as_path()] {
        let o = run(Command::new(bin("sdq")).arg("inspect").arg(path), 60);
        assert_eq!(o.status.code(), Some(1), "{}", path.display());
        let err = stderr(&o);
        assert!(err.contains(&path.display().to_string()) && !err.contains("panicked"), "{err}");
    }
}

/// Against live runs of each family (the tools' default context, the
/// model's own): the layers inspect pages are the run's (a NextN block is
/// not), its estimate of anonymous memory after load is within 12 MiB of the
/// run's, and a budget near the minimum that runs is one inspect plans for.
#[test]
fn inspect_matches_live_runs_of_each_family() {
    const MIB: u64 = 1 << 20;
    for family in ["qwen35moe", "gpt-oss", "deepseek2", "glm4moe", "gemma4", "llama"] {
        let model = crate::families::family_model(family);
        let stats = scratch().join(format!("inspect-live-{family}.json"));
        let live = |budget: &str| {
            let _ = std::fs::remove_file(&stats);
            let o = run(
                Command::new(bin("llama-completion"))
                    .args(["-m", model.to_str().unwrap(), "-p", "Hello there", "-n", "4", "-t", "2", "-no-cnv", "--top-k", "1"])
                    .args(["--ram-budget", budget, "--sdq-reserve", "16M", "--sdq-stats", stats.to_str().unwrap()]),
                120,
            );
            assert!(o.status.success(), "{family} at {budget}: {}", stderr(&o));
            serde_json::from_str::<Value>(&std::fs::read_to_string(&stats).unwrap()).unwrap()
        };
        let inspect = |budget: &str| {
            let o = run(Command::new(bin("sdq")).args(["inspect", "--json", "--ram-budget", budget, "--sdq-reserve", "16M"]).arg(&model), 60);
            assert!(o.status.success(), "{}", stderr(&o));
            serde_json::from_str::<Value>(&stdout(&o)).unwrap()
        };
        let s = live("1G");
        let r = inspect("1G");
        let run_layers: u64 = s["slot_classes"].as_array().unwrap().iter().map(|c| u(c, "layers")).sum();
        assert_eq!(r["layers"].as_array().unwrap().len() as u64, run_layers, "{family}: paged layers");
        assert_eq!(r["nextn_skipped_bytes"].as_u64().unwrap() > 0, family == "glm4moe", "{family}: {}", r["nextn_skipped_bytes"]);
        let measured = u(&s, "rss_anon_after_load_bytes");
        let estimate = u(&r["budget"], "anonymous_after_load_estimate_bytes");
        assert!(estimate.abs_diff(measured) <= 12 * MIB, "{family}: estimate {} MiB, measured {} MiB", estimate / MIB, measured / MIB);

        let min_arena = min_arena(&s);
        // What the run counted as held: its memory after load and its
        // compute buffers not yet touched (inspect counts them in full).
        let held = held_after_load(&s);
        let near_min = (held + 16 * MIB + min_arena + 6 * MIB).to_string();
        let tight = live(&near_min);
        assert!(u(&tight, "peak_rss_anon_bytes") <= near_min.parse().unwrap(), "{family}: {tight}");
        let planned = inspect(&near_min);
        assert!(planned["budget"].get("error").is_none(), "{family}: inspect says a budget that runs cannot: {}", planned["budget"]);
        let min_budget = u(&planned["budget"], "min_budget_bytes");
        assert!(
            min_budget.abs_diff(held + 16 * MIB + min_arena) <= 12 * MIB,
            "{family}: smallest budget {} MiB, the run's {} MiB",
            min_budget / MIB,
            (held + 16 * MIB + min_arena) / MIB
        );
    }
}

/// A file the fuzzer found (`gguf_file`): a model whose block_count is far
/// beyond its tensors made the context estimate loop over every claimed
/// layer (40 s). The estimate now walks the tensors that exist.
#[test]
fn inspect_is_quick_on_a_huge_block_count() {
    let model = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/fuzz-inspect-huge-block-count.gguf");
    let start = std::time::Instant::now();
    let o = run(Command::new(bin("sdq")).args(["inspect", "--json", "--ram-budget", "8G"]).arg(&model), 60);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(start.elapsed() < std::time::Duration::from_secs(5), "inspect took {:?}", start.elapsed());
}
