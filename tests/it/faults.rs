//! Faults while paging: injected read faults (`SDQ_FAULT_READ`), a model file
//! truncated or replaced under a running process, Ctrl-C during a read, and a
//! stats file that cannot be written. Each run either gives exactly stock's
//! output or stops with an error naming the file, layer and expert, and its
//! output so far is a prefix of stock's: no token comes from a bad read.

use crate::util::*;
use serde_json::Value;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const PROMPT: &str = "The quick brown fox";

fn args(model: &Path, n: u32) -> Vec<String> {
    let mut a = completion_args(model, PROMPT, n);
    a.push("--no-repack".into());
    a
}

/// Stock's output, and a budget that keeps the arena at one layer's top-k
/// (plus a little), so misses and evictions never stop.
fn stock_and_tight_budget(model: &Path, n: u32) -> (String, String) {
    let args = args(model, n);
    let stock = run(Command::new(bin("llama-completion")).args(&args).env(PLAIN.0, PLAIN.1), 300);
    assert!(stock.status.success(), "{}", stderr(&stock));
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    (stdout(&stock), tight_budget("llama-completion", &refs, &[PLAIN], 0))
}

/// A paged run with `faults` injected into its reads. Preloading is off: the
/// faults are aimed at reads the batches wait for (a 1G budget holds every
/// expert, which would otherwise all be read ahead at start).
fn paged(model: &Path, n: u32, budget: &str, faults: &str) -> Command {
    let mut c = Command::new(bin("llama-completion"));
    c.args(args(model, n))
        .args(["--ram-budget", budget, "--sdq-reserve", "16M"])
        .env("SDQ_FAULT_READ", faults)
        .env("SDQ_READ_BACKOFF_MS", "10")
        .env("SDQ_PRELOAD", "0")
        .env(PLAIN.0, PLAIN.1);
    c
}

/// Reads 1 (the first miss), 40 (mid-prefill) and 150 (mid-decode, with the
/// minimum arena evicting on every miss).
const AT: [u64; 3] = [1, 40, 150];

/// Waits until the run has written its first stats snapshot (paging has
/// started) within `secs`, asserting it is still running.
fn wait_for_stats(stats: &Path, child: &mut std::process::Child, secs: u64) {
    wait_until("a stats snapshot", secs, || {
        assert!(child.try_wait().unwrap().is_none(), "the run ended early");
        stats.exists().then_some(())
    });
}

#[test]
fn interrupted_and_short_reads_are_retried_to_stock_output() {
    retried_reads_give_stock_output(tiny());
}

/// The same on DeepSeek's layout: a dense first layer (paged layers are not
/// numbered from 0), shared experts, grouped routing.
#[test]
fn interrupted_and_short_reads_are_retried_on_deepseek2() {
    retried_reads_give_stock_output(&crate::families::family_model("deepseek2"));
}

fn retried_reads_give_stock_output(model: &Path) {
    let (stock, budget) = stock_and_tight_budget(model, 32);
    // eintr and short are retried at once; eio*K and eof*K are transient
    // errors that the retries (3 by default, with backoff) get past.
    for kind in ["eintr", "short", "eio", "eof"] {
        for n in AT {
            let fault = if matches!(kind, "eio" | "eof") { format!("{kind}@{n}*3") } else { format!("{kind}@{n}") };
            let stats = scratch().join("retry-stats.json");
            let o = run(paged(model, 32, &budget, &fault).args(["--sdq-stats", stats.to_str().unwrap()]), 300);
            assert!(o.status.success(), "{fault}: {}", stderr(&o));
            assert_eq!(stdout(&o), stock, "{fault}: output differs from stock");
            let s: Value = read_json(&stats);
            let retried = if matches!(kind, "eio" | "eof") { 3 } else { 0 };
            assert_eq!((u(&s, "read_retries"), u(&s, "read_failures")), (retried, 0), "{fault}: {s}");
        }
    }
    // All of them at once, and a slow disk.
    let all: Vec<String> = AT.iter().flat_map(|n| [format!("eintr@{n}"), format!("short@{}", n + 1)]).collect();
    let o = run(&mut paged(model, 32, &budget, &(all.join(",") + ",delay=2")), 300);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(stdout(&o), stock);
}

#[test]
fn failed_reads_stop_the_run_naming_file_layer_and_expert() {
    failed_reads_stop_the_run(tiny());
}

#[test]
fn failed_reads_stop_the_run_on_deepseek2() {
    failed_reads_stop_the_run(&crate::families::family_model("deepseek2"));
}

fn failed_reads_stop_the_run(model_path: &Path) {
    let (stock, budget) = stock_and_tight_budget(model_path, 32);
    let model = model_path.to_str().unwrap();
    // A disk that has died at read N: a read that only a prefetch needed is
    // read again by the batch that uses it, so the fault must stay.
    for (kind, says) in [("eio", "injected read fault: EIO"), ("eof", "file ended after 0 of")] {
        for n in AT {
            let o = run(&mut paged(model_path, 32, &budget, &format!("{kind}@{n}+")), 300);
            assert_eq!(o.status.code(), Some(1), "{kind}@{n}: {}\n{}", o.status, stderr(&o));
            let err = stderr(&o);
            assert!(err.contains(says) && err.contains("of expert") && err.contains("of layer") && err.contains(model), "{kind}@{n}: {err}");
            // A fault that stays outlasts the retries: 1 + 3 tries.
            assert!(err.contains("(after 4 tries)"), "{kind}@{n}: {err}");
            assert!(!err.contains("panicked"), "{kind}@{n}: {err}");
            assert!(stock.starts_with(&stdout(&o)), "{kind}@{n}: output is not a prefix of stock's:\n{}", stdout(&o));
        }
    }
}

/// A panic in the pager's reading code (`panic@N`: sdq's own bug, as a
/// user would meet one) ends a tool as a failed read does: exit 1 with one
/// line naming the read and the panic's place, no panic message or
/// backtrace hint, and the tokens before it stock's.
#[test]
fn a_panic_while_reading_ends_the_tool_with_one_line() {
    let (stock, budget) = stock_and_tight_budget(tiny(), 32);
    for n in AT {
        let o = run(&mut paged(tiny(), 32, &budget, &format!("panic@{n}")), 300);
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(1), "panic@{n}: {}\n{err}", o.status);
        let lines: Vec<&str> = err.lines().filter(|l| l.contains("sdq: error")).collect();
        assert!(lines.len() == 1 && lines[0].contains(&format!("internal error: injected panic on read {n} (SDQ_FAULT_READ)")), "panic@{n}: {err}");
        assert!(lines[0].contains("of expert") && lines[0].contains("of layer") && lines[0].contains("src/engine/pager/io.rs"), "panic@{n}: {err}");
        assert!(!err.contains("panicked") && !err.contains("RUST_BACKTRACE"), "panic@{n}: {err}");
        assert!(stock.starts_with(&stdout(&o)), "panic@{n}: output is not a prefix of stock's:\n{}", stdout(&o));
    }
}

/// A preload read that fails (after its retries) is not remembered as a
/// broken expert: the batch that needs the expert later reads it again, and
/// the run gives stock's output.
#[test]
fn a_failed_preload_read_is_read_again_when_needed() {
    let (stock, _) = stock_and_tight_budget(tiny(), 32);
    // 1G holds every expert: all 128 are queued for preloading at start, and
    // every try of the first read (layer 0, expert 0) fails; 32 tokens use
    // every expert.
    let stats = scratch().join("preload-fault-stats.json");
    let o = run(paged(tiny(), 32, "1G", "eio@1").env("SDQ_PRELOAD", "1").args(["--sdq-stats", stats.to_str().unwrap()]), 300);
    assert!(o.status.success(), "{}\n{}", o.status, stderr(&o));
    assert_eq!(stdout(&o), stock, "output differs from stock");
    let s: Value = read_json(&stats);
    assert_eq!((u(&s, "read_retries"), u(&s, "read_failures")), (3, 1), "{s}");
}

#[test]
fn a_bad_fault_plan_is_a_clear_error() {
    let o = run(&mut paged(tiny(), 4, "1G", "boom@3"), 60);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("SDQ_FAULT_READ: 'boom@3': unknown fault 'boom'"), "{}", stderr(&o));
}

/// A model file changed in place under a running process ends the run with
/// an error; one replaced by a rename is harmless (the open descriptor still
/// reads the old file) and the output stays stock's.
#[test]
fn a_model_file_changed_while_running() {
    let n = 48;
    for how in ["truncated", "replaced"] {
        let model = scratch().join(format!("tiny-{how}.gguf"));
        std::fs::copy(tiny(), &model).unwrap();
        let (stock, budget) = stock_and_tight_budget(&model, n);
        // 20 ms per read: the run lasts several seconds. The file changes
        // once a stats snapshot counts 40 reads: the load, which must not
        // see the change, is over, and the run is well into its reads.
        let stats = scratch().join(format!("stats-{how}.json"));
        let _ = std::fs::remove_file(&stats);
        let mut child =
            paged(&model, n, &budget, "delay=20").args(["--sdq-stats", stats.to_str().unwrap()]).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
        wait_for_stats(&stats, &mut child, 120);
        stats_when(&stats, 60, "40 reads", |s| u(s, "misses") >= 40);
        assert!(child.try_wait().unwrap().is_none(), "{how}: the run ended before the file changed");
        if how == "truncated" {
            let len = std::fs::metadata(&model).unwrap().len();
            std::fs::OpenOptions::new().write(true).open(&model).unwrap().set_len(len / 2).unwrap();
        } else {
            let other = gen_model(&format!("tiny-other-{how}.gguf"), &small_vocab(&["--preset", "tiny", "--seed", "9"]));
            let tmp = scratch().join("replacement.tmp");
            std::fs::copy(other, &tmp).unwrap();
            std::fs::rename(&tmp, &model).unwrap();
        }
        let o = wait_with_timeout(child, 300);
        let err = stderr(&o);
        if how == "truncated" {
            assert_eq!(o.status.code(), Some(1), "{how}: {}\n{err}", o.status);
            assert!(err.contains(model.to_str().unwrap()) && err.contains("of layer"), "{how}: {err}");
            assert!(err.contains("changed while it was in use") || err.contains("file ended after"), "{how}: {err}");
            assert!(stock.starts_with(&stdout(&o)), "{how}: output is not a prefix of stock's:\n{}", stdout(&o));
        } else {
            assert!(o.status.success(), "{how}: {err}");
            assert_eq!(stdout(&o), stock, "{how}: output differs from stock");
        }
    }
}

#[test]
fn ctrl_c_during_a_read_exits_promptly_and_the_stats_file_is_json() {
    let stats = scratch().join("stats-sigint.json");
    let _ = std::fs::remove_file(&stats);
    // 300 ms per read: the process is inside a read most of the time.
    let mut child =
        paged(tiny(), 256, "1G", "delay=300").args(["--sdq-stats", stats.to_str().unwrap()]).stdout(Stdio::null()).stderr(Stdio::piped()).spawn().unwrap();
    wait_for_stats(&stats, &mut child, 60);
    // Reads have started: the process is inside one most of the time.
    stats_when(&stats, 60, "a read done", |s| u(s, "misses") > 0);
    // SAFETY: signalling our own child by its pid.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    let sent = Instant::now();
    let o = wait_with_timeout(child, 30);
    assert!(sent.elapsed() < Duration::from_secs(5), "took {:?} to exit after SIGINT", sent.elapsed());
    assert_eq!(o.status.code(), Some(130), "{}: {}", o.status, stderr(&o));
    let s = read_json(&stats);
    assert!(u(&s, "misses") > 0, "{s}");
}

#[test]
fn an_unwritable_stats_file_is_a_warning_not_a_failure() {
    let args = args(tiny(), 8);
    let stock = run(Command::new(bin("llama-completion")).args(&args).env(PLAIN.0, PLAIN.1), 300);
    let o = run(Command::new(bin("llama-completion")).args(&args).args(["--ram-budget", "1G", "--sdq-stats", "/dev/full"]).env(PLAIN.0, PLAIN.1), 300);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("sdq: warning: cannot write stats to /dev/full"), "{}", stderr(&o));
    assert_eq!(stdout(&o), stdout(&stock));
    let dir = scratch().join("no-such-dir").join("stats.json");
    let o = run(Command::new(bin("llama-completion")).args(&args).args(["--ram-budget", "1G", "--sdq-stats", dir.to_str().unwrap()]), 300);
    assert!(o.status.success() && stderr(&o).contains("cannot write stats"), "{}", stderr(&o));
}

/// llama-cli shares llama-server's code (and its abort callback), but a
/// failed read still ends it with exit 1 and the error, as llama-completion.
#[test]
fn a_failed_read_ends_llama_cli() {
    let model = tiny().to_str().unwrap();
    let o = run(
        Command::new(bin("llama-cli"))
            .args(["-m", model, "-st", "-p", "Hello", "-n", "16", "--top-k", "1", "-t", "2", "-c", "512", "--ram-budget", "1G"])
            .env("SDQ_FAULT_READ", "eio@1+")
            .env("SDQ_READ_BACKOFF_MS", "1")
            .env("SDQ_PRELOAD", "0"),
        300,
    );
    assert_eq!(o.status.code(), Some(1), "{}\n{}", o.status, stderr(&o));
    let err = stderr(&o);
    assert!(err.contains("injected read fault: EIO") && err.contains("of expert") && err.contains(model) && !err.contains("abandoned"), "{err}");
}
