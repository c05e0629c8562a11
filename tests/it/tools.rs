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
    assert!(text.starts_with("The quick brown fox"), "prompt not echoed: {text:?}");
    assert!(text.len() > "The quick brown fox".len(), "nothing generated: {text:?}");
    assert_eq!(text, stdout(&b), "greedy output differs between runs");
}

#[test]
fn cli_answers_one_turn() {
    let model = tiny().to_str().unwrap();
    let o = run(
        Command::new(bin("llama-cli")).args(["-m", model, "-st", "-p", "Hello", "-n", "8", "--top-k", "1", "-t", "2", "-c", "512"]),
        300,
    );
    assert!(o.status.success(), "llama-cli failed ({}):\n{}", o.status, stderr(&o));
}

#[test]
fn server_answers_completion_and_chat() {
    let model = tiny().to_str().unwrap();
    let (_server, port) = start_server(&["-m", model, "-c", "1024", "-t", "2", "--no-warmup"]);
    let (status, body) =
        http(port, "POST", "/completion", Some(r#"{"prompt":"Once upon a time","n_predict":8,"temperature":0}"#)).unwrap();
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
    let o = run(
        Command::new(bin("llama-perplexity")).args(["-m", model, "-f", text.to_str().unwrap(), "-c", "128", "--chunks", "4", "-t", "2", "-b", "128"]),
        300,
    );
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
    let o = run(
        Command::new(bin("llama-quantize")).args(["--allow-requantize"]).arg(tiny()).arg(&out).args(["Q8_0", "2"]),
        300,
    );
    assert!(o.status.success(), "llama-quantize failed:\n{}", stderr(&o));
    let c = run(Command::new(bin("llama-completion")).args(completion_args(&out, "Hello", 8)), 300);
    assert!(c.status.success(), "re-quantized model does not run:\n{}", stderr(&c));
    let ts = sdq::gguf::Gguf::open(&out).unwrap().tensors();
    let down = ts.iter().find(|t| t.name == "blk.0.ffn_down_exps.weight").unwrap();
    assert_eq!(down.ty, sdq::ggml::GgmlType::Q8_0, "model was not re-quantized");
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
    for tool in ["llama-cli", "llama-completion", "llama-server", "llama-bench", "llama-perplexity", "llama-quantize", "sdq"] {
        let o = run(Command::new("ldd").arg(bin(tool)), 60);
        let libs = stdout(&o);
        assert!(!libs.is_empty(), "ldd printed nothing for {tool}");
        for shared in ["libllama", "libggml", "libmtmd"] {
            assert!(!libs.contains(shared), "{tool} links {shared} dynamically:\n{libs}");
        }
    }
}
