//! Concurrency and load: llama-server with `--parallel 4` in a budget so
//! tight that eviction never stops, driven by 16 concurrent clients on
//! loopback. Answers must be stock's (bar the near-ties stock itself flips
//! under concurrency), every request
//! must finish within its timeout, and over a 1,000-request soak the server's
//! anonymous RSS and open file descriptors must stay flat, through a stretch
//! in the middle where every read fails (those requests get sdq's error;
//! every one after it is answered) and, later, a memory limit lowered below
//! the budget and raised again (the arena shrinks and grows back, every
//! request is answered, nothing is OOM-killed).

use crate::util::*;
use serde_json::Value;
use std::time::Instant;

const CLIENTS: usize = 16;

/// The inodes of the loopback sockets listening now (state 0A in
/// /proc/net/tcp and tcp6).
fn listening_inodes() -> std::collections::HashSet<String> {
    let mut inodes = std::collections::HashSet::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        for line in std::fs::read_to_string(table).unwrap_or_default().lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.get(3) == Some(&"0A") {
                if let Some(inode) = f.get(9) {
                    inodes.insert(inode.to_string());
                }
            }
        }
    }
    inodes
}

/// What the process has open, by kind: each file by its path; sockets as
/// listening or connected; pipes and anonymous inodes by kind alone (their
/// numbers change from run to run).
fn open_fds(pid: u32) -> std::collections::BTreeMap<String, usize> {
    let listening = listening_inodes();
    let mut table = std::collections::BTreeMap::new();
    for entry in std::fs::read_dir(format!("/proc/{pid}/fd")).unwrap().flatten() {
        let Ok(target) = std::fs::read_link(entry.path()) else { continue }; // closed meanwhile
        let target = target.to_string_lossy().into_owned();
        let kind = match target.split_once(":[") {
            Some(("socket", inode)) if listening.contains(inode.trim_end_matches(']')) => "socket (listening)".to_string(),
            Some(("socket", _)) => "socket (connection)".to_string(),
            Some((kind, _)) => kind.to_string(),
            None => target,
        };
        *table.entry(kind).or_insert(0) += 1;
    }
    table
}

/// The open descriptors once nothing is in flight. Two kinds are open only
/// for a moment, and are waited for (never counted as a leak): the socket
/// of a request just answered (its client sees the end of the answer when
/// the server shuts the socket down, a moment before the server closes it),
/// and the temporary file the stats are written through each second
/// (`.NAME.PID.tmp`, renamed over the stats file).
fn settled_fds(pid: u32) -> std::collections::BTreeMap<String, usize> {
    let settled = || Some(open_fds(pid)).filter(|table| !table.keys().any(|k| k == "socket (connection)" || k.ends_with(".tmp")));
    poll_until(10, settled).unwrap_or_else(|| open_fds(pid))
}

fn complete(port: u16, prompt: &str, n: u32) -> String {
    let body = format!(r#"{{"prompt":"{prompt}","n_predict":{n},"temperature":0,"cache_prompt":false}}"#);
    let (status, body) = http(port, "POST", "/completion", Some(&body)).expect("request within its timeout");
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    v["content"].as_str().unwrap().to_string()
}

/// Calls `request(i)` for every index of `prompts`, from `clients` threads
/// at once, each taking the next index when it is done.
fn for_each_concurrently(prompts: &[String], clients: usize, request: impl Fn(usize) + Sync) {
    let next = std::sync::atomic::AtomicUsize::new(0);
    std::thread::scope(|s| {
        for _ in 0..clients {
            s.spawn(|| loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if i >= prompts.len() {
                    break;
                }
                request(i);
            });
        }
    });
}

/// Like `drive`, for requests that may meet a failing disk: the number that
/// failed, each with sdq's error naming the expert and layer.
fn drive_through_faults(port: u16, prompts: &[String], n: u32, clients: usize) -> usize {
    let failed = std::sync::atomic::AtomicUsize::new(0);
    for_each_concurrently(prompts, clients, |i| {
        let body = format!(r#"{{"prompt":"{}","n_predict":{n},"temperature":0,"cache_prompt":false}}"#, prompts[i]);
        let (status, body) = http(port, "POST", "/completion", Some(&body)).expect("request within its timeout");
        if status != 200 {
            assert!(status == 500 && body.contains("of expert") && body.contains("of layer"), "{status}: {body}");
            failed.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
    });
    failed.into_inner()
}

/// `prompts` sent by `clients` threads at once; responses in prompt order.
fn drive(port: u16, prompts: &[String], n: u32, clients: usize) -> Vec<String> {
    let out = std::sync::Mutex::new(vec![String::new(); prompts.len()]);
    for_each_concurrently(prompts, clients, |i| {
        let r = complete(port, &prompts[i], n);
        out.lock().unwrap()[i] = r;
    });
    out.into_inner().unwrap()
}

fn prompts(count: usize) -> Vec<String> {
    let words = ["river", "lamp", "harbour", "apple", "letter", "stone", "garden", "bridge", "winter", "engine", "market", "violin"];
    (0..count).map(|i| format!("The {} and the {} near the {}", words[i % 12], words[(i / 12) % 12], words[(i * 7) % 12])).collect()
}

#[test]
fn a_server_under_constant_eviction_answers_16_clients_like_stock_and_stays_flat() {
    let model = tiny().to_str().unwrap();
    let common = ["-m", model, "-c", "2048", "-np", "4", "-t", "2", "--no-warmup", "--no-repack", "--cache-ram", "0"];

    // What the server holds after load, from its own stats snapshot.
    let probe_stats = scratch().join("stats-server-probe.json");
    let _ = std::fs::remove_file(&probe_stats);
    let held = {
        let (_server, port) = start_server_env(&[&common[..], &["--ram-budget", "2G", "--sdq-stats", probe_stats.to_str().unwrap()]].concat(), &[PLAIN]);
        complete(port, "Hello", 2);
        let s = stats_when(&probe_stats, 30, "a stats snapshot from the server", |_| true);
        held_after_load(&s) + min_arena(&s)
    };
    // The minimum arena plus 2 MiB (anonymous RSS after load varies a little):
    // 4 slots decoding at once keep evicting. The reserve covers what the
    // server allocates after load for 16 connections (measured: about 20 MiB).
    let budget = (held + 64 * (1 << 20) + 2 * (1 << 20)).to_string();

    // Stock's own greedy answer to a prompt can depend on what it was
    // batched with (a near-tie flips with the order of a reduction): the
    // reference for each prompt is every answer stock gave it, alone and in
    // two concurrent runs.
    let first = prompts(64);
    let stock: Vec<Vec<String>> = [(1, "alone"), (CLIENTS, "concurrent"), (CLIENTS, "concurrent again")]
        .iter()
        .map(|&(clients, _)| {
            let (_server, port) = start_server_env(&common, &[PLAIN]);
            drive(port, &first, 12, clients)
        })
        .collect();
    let varied = (0..first.len()).filter(|&i| stock.iter().any(|r| r[i] != stock[0][i])).count();
    eprintln!("stock's answer varied with batching for {varied} of {} prompts", first.len());
    // Measured: 3 or 4 of the 64 usually, 8 in one clean-clone CI run of
    // 2026-12-01. Past a quarter, "any of stock's answers" would accept too
    // much for the comparison below to mean anything.
    assert!(varied * 4 < first.len(), "stock too unstable to compare against: {varied} prompts varied");
    let stats = scratch().join("stats-server-soak.json");
    // Halfway through the soak the disk fails for a while: every read fails
    // while this file exists.
    let failing_disk = scratch().join("soak-disk-fails");
    let _ = std::fs::remove_file(&failing_disk);
    let faults = format!("eio-while={}", failing_disk.display());
    let args = [&common[..], &["--ram-budget", &budget, "--sdq-reserve", "64M", "--sdq-stats", stats.to_str().unwrap()]].concat();
    let env = [PLAIN, ("SDQ_FAULT_READ", &faults), ("SDQ_READ_BACKOFF_MS", "1")];
    // In a memory cgroup (64 MiB over the budget, so the budget is what
    // binds) where one can be made, for the limit change below.
    let budget_bytes: u64 = budget.parse().unwrap();
    let log = scratch().join("server-soak.log");
    let limited = start_server_limited(&(budget_bytes + (64 << 20)).to_string(), &args, &env, &log);
    let unconfined = if limited.is_none() { Some(start_server_env(&args, &env)) } else { None };
    let (pid, port) = match (&limited, &unconfined) {
        (Some(s), _) => (s.pid, s.port),
        (None, Some((server, port))) => (server.0.id(), *port),
        (None, None) => unreachable!("one server or the other"),
    };
    let paged = drive(port, &first, 12, CLIENTS);
    // Stock itself flips a few near-ties from run to run under concurrency
    // (3 or 4 of these 64 prompts in one test, up to 3 between two runs even
    // with -ub 1 -no-kvu), so an exact match for every prompt would be
    // flaky. A pager fault does not flip near-ties: wrong expert bytes under
    // constant eviction corrupt nearly every answer. The single-sequence
    // paths are compared bit for bit in pager.rs.
    let odd: Vec<usize> = (0..first.len()).filter(|&i| !stock.iter().any(|r| r[i] == paged[i])).collect();
    eprintln!("answers none of stock's runs gave: {} of {} (prompts {odd:?})", odd.len(), first.len());
    assert!(odd.len() * 8 <= first.len(), "{} of {} answers under eviction are none of stock's: prompts {odd:?}", odd.len(), first.len());
    // The soak: 1,000 requests in all, RSS and descriptors after the first
    // 100 against the end.
    let soak = prompts(936);
    drive(port, &soak[..36], 4, CLIENTS);
    let (rss_before, fds_before) = (rss_anon_of(pid), settled_fds(pid));
    let started = Instant::now();
    drive(port, &soak[36..436], 4, CLIENTS);
    std::fs::write(&failing_disk, b"").unwrap();
    let failed = drive_through_faults(port, &soak[436..468], 4, CLIENTS);
    std::fs::remove_file(&failing_disk).unwrap();
    assert!(failed > 0, "no request failed while every read failed");
    // Every request after the failing stretch is answered (drive asserts
    // it), also while the limit falls 16 MiB below the budget (more than
    // the arena's 2 MiB over its minimum: it shrinks to one layer's top-k)
    // and when it is raised again.
    drive(port, &soak[468..600], 4, CLIENTS);
    let change = |limit: u64, range: std::ops::Range<usize>| {
        std::thread::scope(|sc| {
            let requests = sc.spawn(|| drive(port, &soak[range], 4, CLIENTS));
            wait_processing(port, || requests.is_finished());
            if limited.is_some() {
                set_limit(pid, limit);
            }
            requests.join().unwrap();
        })
    };
    change(budget_bytes - (16 << 20), 600..700);
    change(budget_bytes + (64 << 20), 700..800);
    drive(port, &soak[800..], 4, CLIENTS);
    let (rss_after, fds_after) = (rss_anon_of(pid), settled_fds(pid));
    let drift = rss_after as i64 - rss_before as i64;
    eprintln!(
        "soak: 900 requests in {:.1} s, {failed} of 32 failed while the disk failed; RssAnon {} -> {} bytes (drift {drift}); open descriptors {fds_before:?} -> {fds_after:?}",
        started.elapsed().as_secs_f64(),
        rss_before,
        rss_after
    );
    assert!(drift.abs() < 8 << 20, "anonymous RSS drifted by {drift} bytes over 900 requests");
    assert_eq!(fds_after, fds_before, "the server's open descriptors changed over 900 requests");
    assert!(rss_after <= budget.parse::<u64>().unwrap(), "RssAnon {rss_after} over the budget {budget}");
    let s: Value = read_json(&stats);
    assert!(u(&s, "misses") > u(&s, "hits") / 4, "the arena was not under pressure: {s}");
    assert!(u(&s, "read_failures") > 0, "{s}");
    if let Some(server) = limited {
        let s = stats_when(&stats, 10, "the limit change counted", |s| u(s, "arena_grows") >= 1);
        assert_eq!((u(&s, "arena_shrinks"), u(&s, "arena_grows")), (1, 1), "{s}");
        assert!(u(&s, "arena_smallest_bytes") < u(&s, "arena_planned_bytes"), "{s}");
        let report = server.stop();
        assert_eq!(report["oom_kills"], 0, "{report}");
        assert_eq!(report["swap_bytes"], 0, "{report}");
    }
}
