//! Split GGUFs, as `llama-gguf-split` writes them: a model in several parts
//! runs under a budget exactly as the whole file does, experts whose gate, up
//! and down tensors lie in different parts included; a missing part, or a
//! part of another split, is one clear error.

use crate::pager::{budget_for, eval, max_abs_diff, MIB};
use crate::util::*;
use sdq::engine::model::gguf::Gguf;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Splits `model` with the drop-in `llama-gguf-split` at `max_tensors`
/// tensors per part; returns the parts in order.
fn split(model: &Path, prefix: &str, max_tensors: usize) -> Vec<PathBuf> {
    let out = scratch().join(prefix);
    for old in std::fs::read_dir(scratch()).unwrap().flatten() {
        if old.file_name().to_string_lossy().starts_with(&format!("{prefix}-")) {
            std::fs::remove_file(old.path()).unwrap();
        }
    }
    let o = run(Command::new(bin("llama-gguf-split")).args(["--split", "--split-max-tensors", &max_tensors.to_string()]).arg(model).arg(&out), 120);
    assert!(o.status.success(), "llama-gguf-split: {}", stderr(&o));
    let n = Gguf::open(model).unwrap().tensors().len().div_ceil(max_tensors);
    (1..=n).map(|i| scratch().join(format!("{prefix}-{i:05}-of-{n:05}.gguf"))).collect()
}

/// A tensor count per part that puts a part boundary between some layer's
/// gate and up experts, with at least 3 parts.
fn boundary_inside_an_expert(model: &Path) -> usize {
    let names: Vec<String> = Gguf::open(model).unwrap().tensors().into_iter().map(|t| t.name).collect();
    let ups: Vec<usize> = names.iter().enumerate().filter(|(_, n)| n.ends_with("ffn_up_exps.weight")).map(|(i, _)| i).collect();
    (4..=names.len() / 3).rev().find(|k| ups.iter().any(|i| i % k == 0)).expect("a part size that splits an expert")
}

#[test]
fn a_model_in_several_parts_runs_as_the_whole_file() {
    for family in ["qwen35moe", "deepseek2"] {
        let model = crate::families::family_model(family);
        let per_part = boundary_inside_an_expert(&model);
        let parts = split(&model, &format!("split-{family}"), per_part);
        assert!(parts.len() >= 3, "{family}: {} parts", parts.len());
        // Some layer's gate and up experts are in different files.
        let part_of = |name: &str| parts.iter().position(|p| Gguf::open(p).unwrap().tensors().iter().any(|t| t.name == name));
        let split_layer = (0..4).find(|il| {
            let gate = part_of(&format!("blk.{il}.ffn_gate_exps.weight"));
            gate.is_some() && gate != part_of(&format!("blk.{il}.ffn_up_exps.weight"))
        });
        assert!(split_layer.is_some(), "{family}: no expert spans two parts");

        let base = ["-p", "The river ran past the old mill and under the bridge", "-n", "16", "-t", "2", "-c", "512"];
        let whole = eval(&model, &format!("split-{family}-stock"), &base);
        let probe = eval(&parts[0], &format!("split-{family}-probe"), &[&base[..], &["--ram-budget", "2G", "--sdq-reserve", "16M"]].concat());
        let stats = probe.stats.unwrap();
        let min = min_arena(&stats);
        for (name, budget) in [("all", "2G".to_string()), ("minimum", budget_for(&stats, 16 * MIB, min + MIB))] {
            let run = eval(&parts[0], &format!("split-{family}-{name}"), &[&base[..], &["--ram-budget", &budget, "--sdq-reserve", "16M"]].concat());
            assert_eq!(run.json["tokens"], whole.json["tokens"], "{family}, {name} arena: tokens differ from the whole file's");
            assert_eq!(max_abs_diff(&run.logits, &whole.logits), 0.0, "{family}, {name} arena: logits differ");
            assert!(u(run.stats.as_ref().unwrap(), "misses") > 0 || name == "all");
        }
    }
}

#[test]
fn a_missing_or_foreign_part_is_a_clear_error() {
    let model = crate::families::family_model("gpt-oss");
    let parts = split(&model, "split-bad", boundary_inside_an_expert(&model));
    let other = split(&model, "split-other", 8);
    let n = parts.len();
    let try_run = |what: &str, needle: &str| {
        let o = run(Command::new(bin("llama-completion")).args(completion_args(&parts[0], "Hello", 4)).args(["--ram-budget", "1G"]), 120);
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(1), "{what}: {}\n{err}", o.status);
        let last = err.lines().last().unwrap_or("");
        assert!(last.contains(parts[0].to_str().unwrap()) && last.contains(needle), "{what}: {err}");
        assert!(!err.contains("panicked") && stdout(&o).is_empty(), "{what}: {err}");
    };
    let second = std::fs::read(&parts[1]).unwrap();
    // Part 3 in part 2's place.
    std::fs::copy(&parts[2], &parts[1]).unwrap();
    try_run("part 3 as part 2", &format!("split part 2 of {n} does not belong to this model: {} (it says it is part 3 of {n})", parts[1].display()));
    // Part 2 of another split of the same model.
    std::fs::copy(&other[1], &parts[1]).unwrap();
    try_run("another split's part 2", &format!("split part 2 of {n} does not belong to this model"));
    std::fs::write(&parts[1], second).unwrap();
    std::fs::remove_file(&parts[n - 1]).unwrap();
    try_run("last part missing", &format!("split part {n} of {n} is missing: {}", parts[n - 1].display()));
}
