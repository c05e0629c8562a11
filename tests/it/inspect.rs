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
    assert_eq!(w["token_cycle_bytes"], 4 * (4 * small + 4 * large));
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
