//! The drop-in tools run a generated model, as upstream's would.

use crate::util::*;
use std::process::{Command, Stdio};

#[test]
fn completion_is_greedy_and_repeatable() {
    let args = completion_args(tiny(), "The quick brown fox", 16);
    let a = run(Command::new(bin("llama-completion")).args(&args), 300);
    assert!(a.status.success(), "llama-completion failed:\n{}", stderr(&a));
    let b = run(Command::new(bin("llama-completion")).args(&args), 300);
    let text = stdout(&a);
    // SentencePiece's tokenizer (tiny()'s) puts one space before the prompt.
    assert!(text.starts_with(" The quick brown fox"), "prompt not echoed: {text:?}");
    assert!(text.len() > "The quick brown fox".len(), "nothing generated: {text:?}");
    assert_eq!(text, stdout(&b), "greedy output differs between runs");
}

#[test]
fn cli_answers_one_turn() {
    let model = tiny().to_str().unwrap();
    let o = run(Command::new(bin("llama-cli")).args(["-m", model, "-st", "-p", "Hello", "-n", "8", "--top-k", "1", "-t", "2", "-c", "512"]), 300);
    assert!(o.status.success(), "llama-cli failed ({}):\n{}", o.status, stderr(&o));
}

#[test]
fn server_answers_completion_and_chat() {
    let model = tiny().to_str().unwrap();
    let (_server, port) = start_server(&["-m", model, "-c", "1024", "-t", "2", "--no-warmup"]);
    let (status, body) = http(port, "POST", "/completion", Some(r#"{"prompt":"Once upon a time","n_predict":8,"temperature":0}"#)).unwrap();
    assert_eq!(status, 200, "/completion: {body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert!(v["content"].as_str().is_some_and(|s| !s.is_empty()), "/completion: {body}");

    let chat = r#"{"messages":[{"role":"user","content":"Say hi"}],"max_tokens":8,"temperature":0}"#;
    let (status, body) = http(port, "POST", "/v1/chat/completions", Some(chat)).unwrap();
    assert_eq!(status, 200, "/v1/chat/completions: {body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["object"], "chat.completion", "{body}");
    assert!(v["choices"][0]["message"]["content"].is_string(), "{body}");
    assert!(v["usage"]["completion_tokens"].as_u64().is_some_and(|n| n > 0), "{body}");
}

#[test]
fn bench_prints_its_table() {
    let model = tiny().to_str().unwrap();
    let o = run(Command::new(bin("llama-bench")).args(["-m", model, "-t", "2", "-p", "16", "-n", "4", "-r", "1"]), 300);
    assert!(o.status.success(), "llama-bench failed:\n{}", stderr(&o));
    let out = stdout(&o);
    assert!(out.contains("| model") && out.contains("pp16") && out.contains("tg4"), "no table:\n{out}");
    assert!(out.contains("qwen35moe"), "model type missing:\n{out}");
}

#[test]
fn perplexity_is_finite() {
    let text = scratch().join("ppl.txt");
    let para = "The river runs past the old mill and under the stone bridge, where children wait \
                for the boats that carry apples and letters down to the town by the sea. ";
    std::fs::write(&text, para.repeat(40)).unwrap();
    let model = tiny().to_str().unwrap();
    let o =
        run(Command::new(bin("llama-perplexity")).args(["-m", model, "-f", text.to_str().unwrap(), "-c", "128", "--chunks", "4", "-t", "2", "-b", "128"]), 300);
    assert!(o.status.success(), "llama-perplexity failed:\n{}", stderr(&o));
    let all = stdout(&o) + &stderr(&o);
    let ppl: f64 = all
        .split("Final estimate: PPL = ")
        .nth(1)
        .and_then(|s| s.split_whitespace().next())
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no final estimate:\n{all}"));
    assert!(ppl.is_finite() && ppl > 1.0, "perplexity {ppl}");
}

#[test]
fn quantize_output_runs() {
    let out = scratch().join("tiny-q8_0.gguf");
    let _ = std::fs::remove_file(&out);
    let o = run(Command::new(bin("llama-quantize")).args(["--allow-requantize"]).arg(tiny()).arg(&out).args(["Q8_0", "2"]), 300);
    assert!(o.status.success(), "llama-quantize failed:\n{}", stderr(&o));
    let c = run(Command::new(bin("llama-completion")).args(completion_args(&out, "Hello", 8)), 300);
    assert!(c.status.success(), "re-quantized model does not run:\n{}", stderr(&c));
    let ts = sdq::engine::model::gguf::Gguf::open(&out).unwrap().tensors();
    let down = ts.iter().find(|t| t.name == "blk.0.ffn_down_exps.weight").unwrap();
    assert_eq!(down.ty, sdq::engine::ffi::ggml::GgmlType::Q8_0, "model was not re-quantized");
}

#[test]
fn version_reports_the_pinned_commit() {
    let o = run(Command::new(bin("llama-completion")).arg("--version"), 60);
    assert!(o.status.success());
    let all = stdout(&o) + &stderr(&o);
    assert!(all.contains("0c1e570"), "version without the pinned commit:\n{all}");
}

#[test]
fn errors_exit_nonzero_like_upstream() {
    let o = run(Command::new(bin("llama-completion")).args(["-m", "/nonexistent/model.gguf", "-p", "x", "-n", "1", "-no-cnv"]), 60);
    assert!(!o.status.success(), "missing model exited 0");
    let o = run(Command::new(bin("llama-completion")).arg("--no-such-flag"), 60);
    assert!(!o.status.success(), "unknown flag exited 0");
    assert!(stderr(&o).contains("no-such-flag"), "error does not name the flag:\n{}", stderr(&o));
    // Under a budget the same: the error, and no summary of a run that
    // loaded no model.
    let o = run(Command::new(bin("llama-completion")).args(["--no-such-flag", "--ram-budget", "1G"]), 60);
    assert!(!o.status.success(), "unknown flag under a budget exited 0");
    let err = stderr(&o);
    assert!(err.contains("no-such-flag") && !err.lines().any(|l| l.starts_with("sdq:")), "{err}");
}

#[test]
fn sigpipe_kills_like_a_c_program() {
    use std::os::unix::process::ExitStatusExt;
    for tool in ["llama-completion", "llama-bench"] {
        let mut child = Command::new(bin(tool)).arg("--help").stdout(Stdio::piped()).stderr(Stdio::null()).spawn().unwrap();
        drop(child.stdout.take()); // the reader goes away before the tool writes
        let status = child.wait().unwrap();
        assert_eq!(status.signal(), Some(libc::SIGPIPE), "{tool} --help into a closed pipe: {status}");
    }
}

#[test]
fn tools_link_llama_statically() {
    for tool in [
        "llama-cli",
        "llama-completion",
        "llama-server",
        "llama-bench",
        "llama-batched-bench",
        "llama-perplexity",
        "llama-quantize",
        "llama-gguf-split",
        "llama-imatrix",
        "llama-tokenize",
        "llama-mtmd-cli",
        "rpc-server",
        "sdq",
    ] {
        let o = run(Command::new("ldd").arg(bin(tool)), 60);
        let libs = stdout(&o);
        assert!(!libs.is_empty(), "ldd printed nothing for {tool}");
        for shared in ["libllama", "libggml", "libmtmd"] {
            assert!(!libs.contains(shared), "{tool} links {shared} dynamically:\n{libs}");
        }
    }
}

/// llama-batched-bench pages under a budget: several sequences decode at
/// once (a batch of routed rows from different sequences per layer).
#[test]
fn batched_bench_runs_under_a_budget() {
    let model = crate::families::family_model("gpt-oss");
    let stats = scratch().join("batched-bench-stats.json");
    let args = ["-m", model.to_str().unwrap(), "-c", "1024", "-b", "256", "-ub", "64", "-npp", "32", "-ntg", "8", "-npl", "1,4", "-t", "2"];
    let refs: Vec<&str> = args.to_vec();
    let budget = tight_budget("llama-batched-bench", &refs, &[], 0);
    let o = run(
        Command::new(bin("llama-batched-bench")).args(args).args(["--ram-budget", &budget, "--sdq-reserve", "16M", "--sdq-stats", stats.to_str().unwrap()]),
        300,
    );
    assert!(o.status.success(), "{}", stderr(&o));
    // One table row per (prompt, generated, parallel) case: PP and TG speeds.
    let table = stdout(&o);
    let rows: Vec<&str> = table.lines().filter(|l| l.trim_start().starts_with("|    32 |")).map(str::trim).collect();
    assert_eq!(rows.len(), 2, "table rows:\n{}", stdout(&o));
    let s: serde_json::Value = read_json(&stats);
    assert!(u(&s, "misses") > 0 && u(&s, "peak_rss_anon_bytes") <= budget.parse().unwrap(), "{s}");
}

/// llama-tokenize loads only the vocabulary: the same ids with a budget.
#[test]
fn tokenize_gives_the_same_ids_with_a_budget() {
    let args = ["-m", tiny().to_str().unwrap(), "-p", "The river ran past the mill", "--ids", "--log-disable"];
    let stock = run(Command::new(bin("llama-tokenize")).args(args), 60);
    let paged = run(Command::new(bin("llama-tokenize")).args(args).args(["--ram-budget", "1G"]), 60);
    assert!(stock.status.success() && paged.status.success(), "{}\n{}", stderr(&stock), stderr(&paged));
    assert!(stdout(&stock).starts_with('[') && stdout(&stock).len() > 4, "{}", stdout(&stock));
    assert_eq!(stdout(&paged), stdout(&stock));
}

/// llama-imatrix under a budget writes the file stock writes: every expert
/// tensor's sums and counts (collected from sdq's paged matmuls, patch 0003)
/// as well as the rest, byte for byte, at a tight arena.
#[test]
fn imatrix_under_a_budget_writes_stocks_file() {
    for family in ["qwen35moe", "gpt-oss"] {
        let model = crate::families::family_model(family);
        let text = scratch().join("imatrix-text.txt");
        std::fs::write(&text, "river mill bridge children boats apples letters town sea light ".repeat(60)).unwrap();
        let out = |tag: &str| scratch().join(format!("imatrix-{family}-{tag}.gguf"));
        let args = |o: &std::path::Path| -> Vec<String> {
            ["-m", model.to_str().unwrap(), "-f", text.to_str().unwrap(), "-c", "128", "--chunks", "3", "-t", "2", "-o", o.to_str().unwrap()]
                .iter()
                .map(|s| s.to_string())
                .collect()
        };
        let stock = run(Command::new(bin("llama-imatrix")).args(args(&out("stock"))), 300);
        assert!(stock.status.success(), "{}", stderr(&stock));
        let refs: Vec<String> = args(&out("probe"));
        let refs: Vec<&str> = refs.iter().map(String::as_str).collect();
        let budget = tight_budget("llama-imatrix", &refs, &[], 0);
        let stats = scratch().join(format!("imatrix-{family}-stats.json"));
        let paged = run(
            Command::new(bin("llama-imatrix")).args(args(&out("paged"))).args([
                "--ram-budget",
                &budget,
                "--sdq-reserve",
                "16M",
                "--sdq-stats",
                stats.to_str().unwrap(),
            ]),
            300,
        );
        assert!(paged.status.success(), "{}", stderr(&paged));
        let s: serde_json::Value = read_json(&stats);
        assert!(u(&s, "misses") > 0, "{family}: {s}");
        let names: Vec<String> = sdq::engine::model::gguf::Gguf::open(&out("paged")).unwrap().tensors().into_iter().map(|t| t.name).collect();
        assert!(
            names.iter().any(|n| n.contains("ffn_down_exps")) && names.iter().any(|n| n.contains("ffn_gate_exps")),
            "{family}: no expert statistics in {names:?}"
        );
        assert!(std::fs::read(out("paged")).unwrap() == std::fs::read(out("stock")).unwrap(), "{family}: the imatrix differs from stock's");
    }
}

/// llama-mtmd-cli is linked in and takes sdq's options; without a projector
/// it stops with upstream's own message.
#[test]
fn mtmd_cli_is_a_drop_in_tool() {
    let o = run(Command::new(bin("llama-mtmd-cli")).arg("--version"), 60);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!((stdout(&o) + &stderr(&o)).contains("0c1e570"));
    let o = run(Command::new(bin("llama-mtmd-cli")).args(["-m", tiny().to_str().unwrap(), "-p", "Hi", "--ram-budget", "1G"]), 120);
    assert!(!o.status.success(), "ran without a projector");
    assert!(!stderr(&o).contains("panicked"), "{}", stderr(&o));
}
