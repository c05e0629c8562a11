//! Every MoE architecture the pinned tree knows, as upstream's own test
//! writer makes them (`test-llama-archs -o DIR`: two experts per layer,
//! random F32 weights, each architecture's own tensors and keys): under the
//! tightest budget + 1 MiB and + 64 MiB, with defaults and `--no-repack`,
//! the greedy tokens and final logits are stock's with the same flags, and
//! so are they for a prompt of five ubatches in one llama_decode, computed
//! layer by layer across them (patch 0013). So no
//! change to the hook, the plan or the preflight breaks an architecture that
//! sdq's own generator does not write. A file whose expert tensors the graph
//! never uses cannot be kept inside a budget smaller than the process, and
//! says so.

use crate::pager::{budget_for, eval, max_abs_diff, MIB};
use crate::util::*;
use std::path::PathBuf;
use std::process::Command;

/// The corpus's MoE files (`ARCH-moe.gguf`), written once per run.
fn corpus() -> Vec<PathBuf> {
    let dir = scratch().join("archs");
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let o = run(Command::new(bin("test-llama-archs")).arg("-o").arg(&dir), 600);
        assert!(o.status.success(), "test-llama-archs -o: {}", stderr(&o));
    });
    let mut files: Vec<PathBuf> =
        std::fs::read_dir(&dir).unwrap().flatten().map(|e| e.path()).filter(|p| p.file_name().unwrap().to_string_lossy().ends_with("-moe.gguf")).collect();
    files.sort();
    files
}

fn arch_of(model: &std::path::Path) -> String {
    model.file_name().unwrap().to_string_lossy().trim_end_matches("-moe.gguf").to_string()
}

/// Whether the architecture's experts were paged and a prompt of several
/// ubatches was computed in groups, or what went wrong.
fn check(model: &std::path::Path) -> Result<(bool, bool), String> {
    let arch = arch_of(model);
    let prompt = "The river ran past the old mill, under the stone bridge";
    let reserve = 16 * MIB;
    let mut paged = false;
    for (flags, extra) in [("defaults", &[][..]), ("no-repack", &["--no-repack"][..])] {
        let base = [&["-p", prompt, "-n", "8", "-t", "2", "-c", "256"][..], extra].concat();
        let stock = eval(model, &format!("arch-{arch}-stock-{flags}"), &base);
        let probe = eval(model, &format!("arch-{arch}-probe-{flags}"), &[&base[..], &["--ram-budget", "2G", "--sdq-reserve", "16M"]].concat());
        let stats = probe.stats.unwrap();
        if probe.json["tokens"] != stock.json["tokens"] {
            return Err(format!("{arch} ({flags}): tokens differ from stock with every expert held"));
        }
        if !stats["paged"].as_bool().unwrap_or(false) {
            continue; // checked below: a budget it exceeds is an error
        }
        paged = true;
        let min = min_arena(&stats);
        for (name, extra_arena) in [("tightest+1M", MIB), ("tightest+64M", 64 * MIB)] {
            let budget = budget_for(&stats, reserve, min + extra_arena);
            let run = eval(model, &format!("arch-{arch}-{name}-{flags}"), &[&base[..], &["--ram-budget", &budget, "--sdq-reserve", "16M"]].concat());
            let what = format!("{arch} ({flags}, {name})");
            if run.json["tokens"] != stock.json["tokens"] {
                return Err(format!("{what}: tokens {} differ from stock's {}", run.json["tokens"], stock.json["tokens"]));
            }
            if max_abs_diff(&run.logits, &stock.logits) != 0.0 {
                return Err(format!("{what}: logits differ from stock's"));
            }
            let s = run.stats.unwrap();
            if !sanitized() && u(&s, "peak_rss_anon_bytes") > budget.parse::<u64>().unwrap() {
                return Err(format!("{what}: peak anonymous RSS {} over the budget {budget}", u(&s, "peak_rss_anon_bytes")));
            }
        }
    }
    if paged {
        return grouped_prompt(model).map(|grouped| (true, grouped));
    }
    {
        // Nothing is paged, so nothing keeps the process inside 1 MiB.
        let o = run(Command::new(bin("sdq")).args(["eval", "-m", model.to_str().unwrap(), "-p", prompt, "-n", "4", "-c", "256", "--ram-budget", "1M"]), 300);
        let err = stderr(&o);
        if o.status.code() != Some(1) || !err.contains("was not honoured") {
            return Err(format!("{arch}: nothing paged, and --ram-budget 1M exited {:?} without the error:\n{err}", o.status.code()));
        }
    }
    Ok((false, false))
}

/// A prompt of five ubatches given to one llama_decode, at the tightest
/// budget + 1 MiB: the same tokens and logits as stock with the same flags,
/// and whether its ubatches were computed together (patch 0013).
fn grouped_prompt(model: &std::path::Path) -> Result<bool, String> {
    let arch = arch_of(model);
    let prompt = "The river ran past the old mill, under the stone bridge where the children watched the boats, \
                  and the town beyond it was quiet, its gardens full of apples and its windows full of light";
    let base = ["-p", prompt, "-n", "4", "-t", "2", "-c", "256", "--ubatch", "8", "--batch", "256"];
    // An encoder (or any non-causal graph) takes no batch larger than its
    // ubatch, in stock as under a budget.
    let o = run(Command::new(bin("sdq")).args(["eval", "-m", model.to_str().unwrap()]).args(base), 300);
    if !o.status.success() && stderr(&o).contains("n_ubatch >= n_tokens") {
        return Ok(false);
    }
    let stock = eval(model, &format!("arch-{arch}-grouped-stock"), &base);
    let probe = eval(model, &format!("arch-{arch}-grouped-probe"), &[&base[..], &["--ram-budget", "2G", "--sdq-reserve", "64M"]].concat());
    let stats = probe.stats.unwrap();
    let budget = budget_for(&stats, 64 * MIB, min_arena(&stats) + MIB);
    let run = eval(model, &format!("arch-{arch}-grouped"), &[&base[..], &["--ram-budget", &budget, "--sdq-reserve", "64M"]].concat());
    if run.json["tokens"] != stock.json["tokens"] || max_abs_diff(&run.logits, &stock.logits) != 0.0 {
        return Err(format!("{arch} (a prompt of several ubatches): tokens {} and logits differ from stock's {}", run.json["tokens"], stock.json["tokens"]));
    }
    let s = run.stats.unwrap();
    Ok(u(&s["prompt_groups"], "ubatches") > u(&s["prompt_groups"], "groups"))
}

#[test]
fn every_moe_architecture_of_the_pinned_tree_answers_as_stock_under_a_budget() {
    let files = corpus();
    // 55 at the pinned commit; fewer means the writer changed under us.
    assert!(files.len() >= 50, "test-llama-archs wrote only {} MoE files", files.len());
    let results: Vec<Result<(bool, bool), String>> = files.iter().map(|m| check(m)).collect();
    let failures: Vec<&String> = results.iter().filter_map(|r| r.as_ref().err()).collect();
    assert!(
        failures.is_empty(),
        "{} of {} architectures failed:\n{}",
        failures.len(),
        files.len(),
        failures.iter().map(|s| s.as_str()).collect::<Vec<_>>().join("\n")
    );
    let unpaged: Vec<String> = files.iter().zip(&results).filter(|(_, r)| matches!(r, Ok((false, _)))).map(|(f, _)| arch_of(f)).collect();
    // A prompt of several ubatches is computed in groups wherever experts
    // are paged, but for architectures whose batches keep stock's order.
    let ungrouped: Vec<String> = files.iter().zip(&results).filter(|(_, r)| matches!(r, Ok((true, false)))).map(|(f, _)| arch_of(f)).collect();
    eprintln!("architectures paged but not grouped: {ungrouped:?}");
    assert!(ungrouped.len() <= 5, "{} paged architectures computed no group: {ungrouped:?}", ungrouped.len());
    // These graphs are dense (refact, and ernie4_5's and paddleocr's text
    // models): they never use the expert tensors the writer gives them.
    assert_eq!(unpaged, ["ernie4_5", "paddleocr", "refact"], "architectures whose experts were not paged");
}
