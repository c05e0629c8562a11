//! llama-server under a budget, beyond answering like stock (that is in
//! `pager` and `load`): what it allocates after load is held to the reserve,
//! and a failed read ends it with the error instead of an answer.

use crate::util::*;
use serde_json::Value;
use std::process::Command;
use std::time::{Duration, Instant};

/// The server's exit status, which must come within 30 s (`what` says why
/// it should exit).
fn exit_within_30s(server: &mut KillOnDrop, what: &str) -> std::process::ExitStatus {
    let start = Instant::now();
    loop {
        if let Some(status) = server.0.try_wait().unwrap() {
            return status;
        }
        assert!(start.elapsed() < Duration::from_secs(30), "llama-server did not exit within 30 s {what}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Stops the server with SIGINT (its clean shutdown, which writes the
/// stats) and returns its exit status.
fn stop(mut server: KillOnDrop) -> std::process::ExitStatus {
    // SAFETY: signalling our own child by its pid.
    unsafe { libc::kill(server.0.id() as i32, libc::SIGINT) };
    exit_within_30s(&mut server, "of SIGINT")
}

#[test]
fn prompt_cache_and_checkpoints_are_held_to_the_reserve() {
    let model = tiny().to_str().unwrap();
    // Left alone: sdq sets both from the 128 MiB reserve, and the server says
    // it uses them (-lv 4 prints its trace lines).
    let log = scratch().join("server-growth.log");
    let (server, port) = start_server_logged(
        &["-m", model, "-lv", "4", "--ram-budget", "1G"],
        &[],
        Some(&log),
    );
    let (status, _) = http(
        port,
        "POST",
        "/completion",
        Some(r#"{"prompt":"Hello there","n_predict":4}"#),
    )
    .unwrap();
    assert_eq!(status, 200);
    stop(server);
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(
        text.contains("sdq: notice: under the budget, --cache-ram 64 and --ctx-checkpoints"),
        "{text}"
    );
    assert!(
        text.contains("prompt cache is enabled, size limit: 64 MiB"),
        "{text}"
    );
    let n: u64 = text
        .split("--ctx-checkpoints ")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap();
    assert!(
        text.contains(&format!("context checkpoints enabled, max = {n},")),
        "{text}"
    );

    // Asked for: the reserve (3 GiB / 16 = 192 MiB) grows to hold it with a
    // quarter of itself to spare, and the stats say so.
    let stats = scratch().join("server-growth.json");
    let (server, _) = start_server_logged(
        &[
            "-m",
            model,
            "--ram-budget",
            "3G",
            "--cache-ram",
            "2048",
            "-ctxcp",
            "0",
            "--sdq-stats",
            stats.to_str().unwrap(),
        ],
        &[],
        Some(&log),
    );
    stop(server);
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(text.contains("the reserve is raised to 2.05 GiB"), "{text}");
    let s: Value = serde_json::from_str(&std::fs::read_to_string(&stats).unwrap()).unwrap();
    assert_eq!(u(&s, "reserve_bytes"), (2048 + 48) << 20, "{s}");

    // No limit cannot be held to a budget.
    for (flags, env) in [
        (&["--cache-ram", "-1"][..], None),
        (&[][..], Some(("LLAMA_ARG_CACHE_RAM", "-1"))),
    ] {
        let mut c = Command::new(bin("llama-server"));
        c.args(["-m", model, "--port", "1", "--ram-budget", "1G"])
            .args(flags)
            .envs(env);
        let o = run(&mut c, 60);
        assert_eq!(o.status.code(), Some(1), "{flags:?} {env:?}");
        assert!(
            stderr(&o).contains("--cache-ram -1 (no limit) cannot be held to --ram-budget"),
            "{}",
            stderr(&o)
        );
    }
}

#[test]
fn a_failed_read_ends_the_server_with_the_error_and_no_answer() {
    let model = tiny().to_str().unwrap();
    let log = scratch().join("server-eio.log");
    // Start-up (without warm-up) takes about 100 reads; from read 150 on
    // every read fails (a disk that has died: a prefetch's failed read is
    // otherwise read again by the request that needs it), in one of the
    // first requests. Requests answered before it are fine; the
    // one it falls in must not be answered. (Preloading, which a 1G budget
    // would start, is off: the fault is aimed at a request's own read.)
    let (mut server, port) = start_server_logged(
        &["-m", model, "--no-warmup", "--ram-budget", "1G"],
        &[("SDQ_FAULT_READ", "eio@150+"), ("SDQ_READ_BACKOFF_MS", "10"), ("SDQ_PRELOAD", "0")],
        Some(&log),
    );
    let mut answered = 0;
    for i in 0..20 {
        let body = format!(
            r#"{{"prompt":"Request {i} asks about rivers and {i} mountains","n_predict":16}}"#
        );
        match http(port, "POST", "/completion", Some(&body)) {
            Ok((200, _)) => answered += 1,
            _ => break,
        }
    }
    assert!(
        answered < 20,
        "20 requests answered: the injected fault never happened"
    );
    let status = exit_within_30s(&mut server, "of a failed read");
    assert_eq!(status.code(), Some(1), "{status}");
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(
        text.contains("injected read fault: EIO")
            && text.contains("of expert")
            && text.contains(model),
        "{text}"
    );
    assert!(!text.contains("panicked"), "{text}");
}
