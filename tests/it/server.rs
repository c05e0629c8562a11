//! llama-server under a budget, beyond answering like stock (that is in
//! `pager` and `load`): what it allocates after load is held to the reserve,
//! and a failed read ends it with the error instead of an answer.

use crate::util::*;
use serde_json::Value;
use std::process::Command;
use std::time::Duration;

/// Stops the server with SIGINT (its clean shutdown, which writes the
/// stats) and returns its exit status.
pub(crate) fn stop(mut server: KillOnDrop) -> std::process::ExitStatus {
    let pid = server.0.id();
    interrupt_until_exit(pid, || server.0.try_wait().unwrap()).unwrap_or_else(|| panic!("llama-server did not exit within 30 s of SIGINT"))
}

#[test]
fn prompt_cache_and_checkpoints_are_held_to_the_reserve() {
    let model = tiny().to_str().unwrap();
    // Left alone: sdq sets both from the 128 MiB reserve, and the server says
    // it uses them (-lv 4 prints its trace lines).
    let log = scratch().join("server-growth.log");
    let (server, port) = start_server_logged(&["-m", model, "-lv", "4", "--ram-budget", "1G"], &[], Some(&log));
    let (status, _) = http(port, "POST", "/completion", Some(r#"{"prompt":"Hello there","n_predict":4}"#)).unwrap();
    assert_eq!(status, 200);
    stop(server);
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(text.contains("sdq: notice: under the budget, --cache-ram 64 and --ctx-checkpoints"), "{text}");
    assert!(text.contains("prompt cache is enabled, size limit: 64 MiB"), "{text}");
    let n: u64 = text.split("--ctx-checkpoints ").nth(1).and_then(|r| r.split_whitespace().next()).and_then(|n| n.parse().ok()).unwrap();
    assert!(text.contains(&format!("context checkpoints enabled, max = {n},")), "{text}");

    // Asked for: the reserve (3 GiB / 16 = 192 MiB) grows to hold it with a
    // quarter of itself to spare, and the stats say so.
    let stats = scratch().join("server-growth.json");
    let (server, _) = start_server_logged(
        &["-m", model, "--ram-budget", "3G", "--cache-ram", "2048", "-ctxcp", "0", "--sdq-stats", stats.to_str().unwrap()],
        &[],
        Some(&log),
    );
    stop(server);
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(text.contains("the reserve is raised to 2.05 GiB"), "{text}");
    let s: Value = read_json(&stats);
    assert_eq!(u(&s, "reserve_bytes"), (2048 + 48) << 20, "{s}");

    // Drafting keeps each slot's recurrent state once more, and at least
    // one checkpoint per slot stays (with none the server splits prompts
    // otherwise, and answers unlike stock's defaults): with a reserve too
    // small for either, the reserve grows and says so.
    let (server, _) =
        start_server_logged(&["-m", model, "-lv", "4", "--ram-budget", "1G", "--sdq-reserve", "2M", "--spec-type", "ngram-simple"], &[], Some(&log));
    stop(server);
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(text.contains("--ctx-checkpoints 1 (420.0 KiB each, 4 slots)") && text.contains("and the recurrent state drafting keeps"), "{text}");
    assert!(text.contains("context checkpoints enabled, max = 1,"), "{text}");

    // No limit cannot be held to a budget.
    for (flags, env) in [(&["--cache-ram", "-1"][..], None), (&[][..], Some(("LLAMA_ARG_CACHE_RAM", "-1")))] {
        let mut c = Command::new(bin("llama-server"));
        c.args(["-m", model, "--port", "1", "--ram-budget", "1G"]).args(flags).envs(env);
        let o = run(&mut c, 60);
        assert_eq!(o.status.code(), Some(1), "{flags:?} {env:?}");
        assert!(stderr(&o).contains("--cache-ram -1 (no limit) cannot be held to --ram-budget"), "{}", stderr(&o));
    }
}

/// The same with four slots and four prompts at once: a batch holding
/// several requests fails them all with the error; the server goes on, and
/// every request answered gets the text stock gives the same four prompts
/// at once. Each round is one request with four prompts, which the server
/// starts in four slots in the same step: the batches are then the same in
/// stock's run and sdq's. (Four separate connections were batched as they
/// happened to arrive, and stock's own greedy text can flip a near-tie with
/// the batch it is computed in.) Each round's prompts are new: a prompt
/// cached by an earlier round would change the batches again.
#[test]
fn failed_reads_in_concurrent_batches_fail_those_requests_only() {
    let model = tiny().to_str().unwrap();
    let body = |r: usize| {
        let prompts: Vec<String> = (0..4).map(|i| format!("\"Round {r} request {i} asks about rivers and {i} mountains\"")).collect();
        format!(r#"{{"prompt":[{}],"n_predict":16,"top_k":1}}"#, prompts.join(","))
    };
    let rounds = |port: u16| -> Vec<(u16, String)> { (0..8).map(|r| http(port, "POST", "/completion", Some(&body(r))).expect("the server answers")).collect() };
    let contents = |b: &str| -> Vec<String> {
        let v: serde_json::Value = serde_json::from_str(b).unwrap_or_else(|e| panic!("{e}: {b}"));
        let mut answers: Vec<(u64, String)> = v
            .as_array()
            .unwrap_or_else(|| panic!("not four answers: {b}"))
            .iter()
            .map(|a| (a["index"].as_u64().unwrap(), a["content"].as_str().unwrap().to_string()))
            .collect();
        answers.sort();
        answers.into_iter().map(|(_, c)| c).collect()
    };
    let (stock_server, port) = start_server(&["-m", model, "--no-warmup", "-np", "4"]);
    let stock = rounds(port);
    drop(stock_server);
    assert!(stock.iter().all(|(c, _)| *c == 200), "stock failed a round");
    let plan: Vec<String> = (150..200).map(|n| format!("eio@{n}")).collect();
    let (server, port) = start_server_env(
        &["-m", model, "--no-warmup", "-np", "4", "--ram-budget", "1G"],
        &[("SDQ_FAULT_READ", &plan.join(",")), ("SDQ_READ_BACKOFF_MS", "1"), ("SDQ_PRELOAD", "0")],
    );
    let paged = rounds(port);
    let mut failed = 0;
    for (r, ((code, b), (_, stock_b))) in paged.iter().zip(&stock).enumerate() {
        if *code == 200 {
            let (got, want) = (contents(b), contents(stock_b));
            assert_eq!(got.len(), 4, "round {r}: {b}");
            assert_eq!(got, want, "round {r}: answered unlike stock");
        } else {
            assert_eq!(*code, 500, "{b}");
            assert!(b.contains("of expert") && b.contains("of layer") && b.contains("injected read fault: EIO"), "{b}");
            failed += 1;
        }
    }
    assert!(failed > 0, "no round failed");
    assert_eq!(paged.last().unwrap().0, 200, "the last round still failed: the server did not recover");
    assert!(stop(server).success());
}

/// A read that fails for good (every try) inside a request costs that
/// batch, not the server: its request gets an HTTP 500 whose JSON names the
/// file, layer and expert, its slot's state is dropped, and the server goes
/// on; every request answered (before and after) gets stock's text.
#[test]
fn a_failed_read_fails_its_batch_and_the_server_goes_on() {
    let model = tiny().to_str().unwrap();
    let requests: Vec<String> =
        (0..12).map(|i| format!(r#"{{"prompt":"Request {i} asks about rivers and {i} mountains","n_predict":16,"top_k":1}}"#)).collect();
    let answers =
        |port: u16| -> Vec<(u16, String)> { requests.iter().map(|b| http(port, "POST", "/completion", Some(b)).expect("the server answers")).collect() };
    let (stock_server, port) = start_server(&["-m", model, "--no-warmup"]);
    let stock = answers(port);
    drop(stock_server);
    // Start-up (without warm-up) takes about 100 reads; reads 150 to 199
    // fail every try (a bad stretch of disk: a read of them that only a
    // prefetch wanted is read again by the request that needs it, and
    // fails again), in the first requests; later reads are fine.
    let plan: Vec<String> = (150..200).map(|n| format!("eio@{n}")).collect();
    let log = scratch().join("server-eio.log");
    let stats = scratch().join("server-eio-stats.json");
    let (mut server, port) = start_server_logged(
        &["-m", model, "--no-warmup", "--ram-budget", "1G", "--sdq-stats", stats.to_str().unwrap()],
        &[("SDQ_FAULT_READ", &plan.join(",")), ("SDQ_READ_BACKOFF_MS", "1"), ("SDQ_PRELOAD", "0")],
        Some(&log),
    );
    let paged = answers(port);
    let failed: Vec<usize> = paged.iter().enumerate().filter(|(_, (code, _))| *code != 200).map(|(i, _)| i).collect();
    assert!(!failed.is_empty(), "no request failed: the injected faults never hit a request's own read");
    for &i in &failed {
        let (code, body) = &paged[i];
        let v: serde_json::Value = serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {body}"));
        let msg = v["error"]["message"].as_str().unwrap_or_default();
        assert_eq!(*code, 500, "{body}");
        assert!(msg.contains("injected read fault: EIO") && msg.contains("of expert") && msg.contains("of layer") && msg.contains(model), "{body}");
    }
    let last_failure = *failed.last().unwrap();
    assert!(last_failure + 3 < requests.len(), "requests {failed:?} failed: too few left to show the server goes on");
    for (i, ((code, body), (_, stock_body))) in paged.iter().zip(&stock).enumerate() {
        if *code == 200 {
            let text = |b: &str| serde_json::from_str::<serde_json::Value>(b).unwrap()["content"].as_str().unwrap().to_string();
            assert_eq!(text(body), text(stock_body), "request {i}: answered unlike stock");
        }
    }
    assert!(server.0.try_wait().unwrap().is_none(), "the server ended");
    let status = stop(server);
    assert!(status.success(), "{status}");
    let s: serde_json::Value = read_json(&stats);
    assert!(u(&s, "read_failures") >= failed.len() as u64 && u(&s, "read_retries") >= 3 * failed.len() as u64, "{s}");
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(text.contains("the batch is abandoned") && !text.contains("panicked"), "{text}");
}

/// A panic in sdq's code inside a request costs that batch, as a failed
/// read does (issue 49): the pager panics on reads 150 to 154
/// (`SDQ_FAULT_READ=panic@N`), the requests whose batches meet them get an
/// HTTP 500 naming the read and the panic, and the server serves the next
/// requests with stock's text; no panic message reaches its log.
#[test]
fn a_panic_fails_its_batch_and_the_server_goes_on() {
    let model = tiny().to_str().unwrap();
    let requests: Vec<String> = (0..8).map(|i| format!(r#"{{"prompt":"Request {i} asks about rivers and {i} mountains","n_predict":16,"top_k":1}}"#)).collect();
    let answers =
        |port: u16| -> Vec<(u16, String)> { requests.iter().map(|b| http(port, "POST", "/completion", Some(b)).expect("the server answers")).collect() };
    let (stock_server, port) = start_server(&["-m", model, "--no-warmup"]);
    let stock = answers(port);
    drop(stock_server);
    let plan: Vec<String> = (150..155).map(|n| format!("panic@{n}")).collect();
    let log = scratch().join("server-panic.log");
    let (mut server, port) =
        start_server_logged(&["-m", model, "--no-warmup", "--ram-budget", "1G"], &[("SDQ_FAULT_READ", &plan.join(",")), ("SDQ_PRELOAD", "0")], Some(&log));
    let paged = answers(port);
    let failed: Vec<usize> = paged.iter().enumerate().filter(|(_, (code, _))| *code != 200).map(|(i, _)| i).collect();
    assert!(!failed.is_empty(), "no request failed: no batch met the panicking reads");
    for &i in &failed {
        let (code, body) = &paged[i];
        assert_eq!(*code, 500, "{body}");
        assert!(body.contains("internal error") && body.contains("injected panic on read") && body.contains("of expert"), "{body}");
    }
    assert!(*failed.last().unwrap() + 2 < requests.len(), "requests {failed:?} failed: too few left to show the server goes on");
    for (i, ((code, body), (_, stock_body))) in paged.iter().zip(&stock).enumerate() {
        if *code == 200 {
            let text = |b: &str| serde_json::from_str::<serde_json::Value>(b).unwrap()["content"].as_str().unwrap().to_string();
            assert_eq!(text(body), text(stock_body), "request {i}: answered unlike stock");
        }
    }
    assert!(server.0.try_wait().unwrap().is_none(), "the server ended");
    assert!(stop(server).success());
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(text.contains("the batch is abandoned") && !text.contains("panicked") && !text.contains("RUST_BACKTRACE"), "{text}");
}

/// A greedy completion (`top_k` 1) of `n` tokens with no prompt cache.
fn greedy(port: u16, prompt: &str, n: u32) -> String {
    let body = format!(r#"{{"prompt":"{prompt}","n_predict":{n},"top_k":1,"temperature":0,"cache_prompt":false}}"#);
    let (status, body) = http(port, "POST", "/completion", Some(&body)).expect("request within its timeout");
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    v["content"].as_str().unwrap().to_string()
}

#[test]
fn the_arena_follows_a_lowered_and_raised_memory_limit_under_a_running_server() {
    // 1.8 GiB of routed experts (4 layers of 256 experts top-8, 1.9 MB
    // each), so that a 2 GiB limit gives an arena of more than a GiB.
    let model_file =
        TempModel::generate("wide-experts.gguf", &["--layers", "4", "--n-embd", "1024", "--experts", "256", "--top-k", "8", "--expert-ff", "1024"]);
    let model = model_file.to_str().unwrap();
    let common = ["-m", model, "-c", "1024", "-np", "1", "-t", "2", "--no-warmup"];
    let words = ["river", "lamp", "harbour", "apple", "letter", "stone", "garden", "bridge", "winter", "engine"];
    let prompts: Vec<String> = (0..10).map(|i| format!("The {} by the {}", words[i], words[(i * 3 + 1) % 10])).collect();
    let stock: Vec<String> = {
        let (_server, port) = start_server(&common);
        prompts.iter().map(|p| greedy(port, p, 8)).collect()
    };

    let stats = scratch().join("server-pressure.json");
    let _ = std::fs::remove_file(&stats);
    let log = scratch().join("server-pressure.log");
    let Some(server) = start_server_limited("2G", &[&common[..], &["--ram-budget", "auto", "--sdq-stats", stats.to_str().unwrap()]].concat(), &[], &log) else {
        return;
    };
    let (pid, port) = (server.pid, server.port);
    let mut answers: Vec<String> = prompts[..2].iter().map(|p| greedy(port, p, 8)).collect();
    let s = stats_when(&stats, 30, "the pager's first figures", |s| s["paged"] == true);
    assert_eq!(u(&s, "budget_bytes"), 2 << 30, "auto did not take the cgroup's limit: {s}");
    let planned = u(&s, "arena_planned_bytes");
    let min_arena = min_arena(&s);
    assert!(planned > (5 << 30) / 4, "the arena is too small for this test: {s}");

    // Lowered by 1 GiB while a request is being answered: the arena gives
    // a GiB back and the process fits under the new limit.
    let lowered = std::thread::scope(|sc| {
        let client = sc.spawn(|| prompts[2..4].iter().map(|p| greedy(port, p, 8)).collect::<Vec<_>>());
        wait_processing(port, || client.is_finished());
        let r = set_limit(pid, 1 << 30);
        answers.extend(client.join().unwrap());
        r
    });
    let figures = |what: &str, r: &Value| {
        eprintln!("{what}: cgroup anonymous memory {} -> {} bytes, limit set after {:.2} s", r["anon_before_bytes"], r["anon_after_bytes"], r["seconds"])
    };
    figures("2 GiB -> 1 GiB", &lowered);
    assert!(lowered["anon_after_bytes"].as_u64().unwrap() + (16 << 20) <= 1 << 30, "{lowered}");
    let s = stats_when(&stats, 10, "arena down by 1 GiB", |s| u(s, "arena_shrinks") >= 1);
    assert_eq!(u(&s, "arena_bytes"), planned - (1 << 30), "{s}");
    assert!(u(&s, "arena_slot_bytes") <= planned - (1 << 30), "{s}");
    assert!(rss_anon_of(pid) <= 1 << 30, "RssAnon {} over the lowered limit", rss_anon_of(pid));
    answers.extend(prompts[4..6].iter().map(|p| greedy(port, p, 8)));

    // Lowered by more than the arena holds: down to one layer's top-k.
    let tight = (2 << 30) - planned - (16 << 20);
    figures(&format!("1 GiB -> {tight}"), &set_limit(pid, tight));
    let s = stats_when(&stats, 10, "arena at its minimum", |s| u(s, "arena_shrinks") >= 2);
    assert_eq!(u(&s, "arena_slot_bytes"), min_arena, "{s}");
    assert!(rss_anon_of(pid) <= tight, "RssAnon {} over the limit {tight}", rss_anon_of(pid));
    answers.extend(prompts[6..8].iter().map(|p| greedy(port, p, 8)));

    // Raised again: the arena grows back to its plan, and fills as it is used.
    figures("raised to 2 GiB", &set_limit(pid, 2 << 30));
    let s = stats_when(&stats, 10, "arena grown back", |s| u(s, "arena_grows") >= 1);
    assert_eq!(u(&s, "arena_bytes"), planned, "{s}");
    answers.extend(prompts[8..].iter().map(|p| greedy(port, p, 8)));

    let report = server.stop();
    assert_eq!(report["oom_kills"], 0, "{report}");
    assert_eq!(report["swap_bytes"], 0, "{report}");
    for (i, (a, b)) in answers.iter().zip(&stock).enumerate() {
        assert_eq!(a, b, "prompt {i} ({}) answered differently from stock", prompts[i]);
    }
    let s: Value = read_json(&stats);
    assert_eq!((u(&s, "arena_shrinks"), u(&s, "arena_grows")), (2, 1), "{s}");
    assert_eq!(u(&s, "arena_smallest_bytes"), min_arena, "{s}");
    let text = std::fs::read_to_string(&log).unwrap();
    assert_eq!(text.matches("the expert arena gives back").count(), 2, "one notice per change:\n{text}");
    assert_eq!(text.matches("the expert arena grows to").count(), 1, "{text}");
}

/// The `sdq_*` samples of a Prometheus text, by name; checks that each has
/// its HELP and TYPE lines, and that counters (and only they) end in `_total`.
fn sdq_samples(text: &str) -> std::collections::BTreeMap<String, f64> {
    let mut samples = std::collections::BTreeMap::new();
    for line in text.lines().filter(|l| l.starts_with("sdq_")) {
        let (name, value) = line.split_once(' ').unwrap_or_else(|| panic!("bad sample line {line:?}"));
        let kind = if name.ends_with("_total") { "counter" } else { "gauge" };
        assert!(text.contains(&format!("# HELP {name} ")), "{name} has no HELP line:\n{text}");
        assert!(text.contains(&format!("# TYPE {name} {kind}\n")), "{name} is not a {kind}:\n{text}");
        assert!(samples.insert(name.to_string(), value.parse::<f64>().unwrap_or_else(|e| panic!("{line}: {e}"))).is_none(), "{name} twice");
    }
    samples
}

/// With `--metrics`, `/metrics` carries the pager's counters and gauges in
/// Prometheus's text format, equal to the stats file's figures once the
/// server is idle, failed reads included; `/props` shows the budget and the
/// arena. Without a budget, both are stock's.
#[test]
fn metrics_and_props_show_the_pagers_figures() {
    let model = tiny().to_str().unwrap();
    let (stock_server, port) = start_server(&["-m", model, "--no-warmup", "--metrics"]);
    let (code, text) = http(port, "GET", "/metrics", None).unwrap();
    assert_eq!(code, 200, "{text}");
    assert!(text.contains("llamacpp:") && !text.contains("sdq_"), "{text}");
    let (_, props) = http(port, "GET", "/props", None).unwrap();
    assert!(serde_json::from_str::<Value>(&props).unwrap().get("sdq").is_none(), "{props}");
    drop(stock_server);

    // Reads 150 to 199 fail every try, as in the test above: some requests fail.
    let plan: Vec<String> = (150..200).map(|n| format!("eio@{n}")).collect();
    let stats = scratch().join("server-metrics-stats.json");
    let (server, port) = start_server_env(
        &["-m", model, "--no-warmup", "--metrics", "--ram-budget", "1G", "--sdq-stats", stats.to_str().unwrap()],
        &[("SDQ_FAULT_READ", &plan.join(",")), ("SDQ_READ_BACKOFF_MS", "1"), ("SDQ_PRELOAD", "0")],
    );
    for i in 0..8 {
        let body = format!(r#"{{"prompt":"Request {i} asks about rivers and {i} mountains","n_predict":16,"top_k":1}}"#);
        http(port, "POST", "/completion", Some(&body)).expect("the server answers");
    }
    let (code, text) = http(port, "GET", "/metrics", None).unwrap();
    assert_eq!(code, 200, "{text}");
    assert!(text.contains("llamacpp:prompt_tokens_total"), "stock's metrics are kept:\n{text}");
    let m = sdq_samples(&text);
    let (_, props) = http(port, "GET", "/props", None).unwrap();
    let props: Value = serde_json::from_str(&props).unwrap();
    assert!(stop(server).success());
    let s: Value = read_json(&stats);
    for (metric, key) in [
        ("sdq_expert_hits_total", "hits"),
        ("sdq_expert_misses_total", "misses"),
        ("sdq_read_bytes_total", "bytes_read"),
        ("sdq_reads_total", "reads"),
        ("sdq_read_failures_total", "read_failures"),
        ("sdq_read_retries_total", "read_retries"),
        ("sdq_arena_shrinks_total", "arena_shrinks"),
        ("sdq_arena_bytes", "arena_bytes"),
        ("sdq_budget_bytes", "budget_bytes"),
        ("sdq_expert_file_bytes", "expert_bytes_total"),
    ] {
        assert_eq!(m.get(metric).copied(), Some(u(&s, key) as f64), "{metric} against the stats' {key}:\n{text}\n{s}");
    }
    assert!(m["sdq_read_failures_total"] > 0.0 && m["sdq_expert_hits_total"] > 0.0 && m["sdq_paged"] == 1.0, "{text}");
    assert_eq!(props["sdq"]["budget_bytes"], 1u64 << 30, "{props}");
    assert_eq!(props["sdq"]["arena_bytes"], s["arena_bytes"], "{props}");
    assert_eq!(props["sdq"]["paged"], true, "{props}");
}

/// The value of stock's Prometheus sample `name` (`llamacpp:NAME`).
fn llamacpp_sample(text: &str, name: &str) -> f64 {
    sample(text, &format!("llamacpp:{name}"))
}

/// The value of Prometheus sample `name` in `/metrics` text.
fn sample(text: &str, name: &str) -> f64 {
    let prefix = format!("{name} ");
    text.lines().find_map(|l| l.strip_prefix(&prefix)).and_then(|v| v.parse().ok()).unwrap_or_else(|| panic!("no {name} in\n{text}"))
}

/// Drafting under a budget (issue 29, point 4): n-gram self-drafting answers
/// exactly as stock with the same flags, and drafts were made and accepted,
/// so the speculative path really ran; so does a dense draft model (-md).
/// The random models loop, which n-gram
/// drafting finds easily: a fair test of the mechanics, not of speed.
#[test]
fn drafting_under_a_budget_answers_as_stock() {
    let model = tiny_preset().to_str().unwrap();
    let prompts = ["The rivers and the mountains and the rivers and the mountains", "Count: one two three four one two three four one two"];
    // Short n-grams, so that drafts start within a 48-token answer.
    let cases: [&[&str]; 3] = [
        &["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3", "--spec-ngram-simple-size-m", "8"],
        &["--spec-type", "ngram-map-k", "--spec-ngram-map-k-size-n", "3", "--spec-ngram-map-k-size-m", "8"],
        &["--spec-type", "ngram-mod"],
    ];
    for flags in cases {
        let mut args = vec!["-m", model, "--no-warmup", "--metrics"];
        args.extend_from_slice(flags);
        let answer = |port: u16| -> Vec<String> { prompts.iter().map(|p| greedy(port, p, 48)).collect() };
        let (stock_server, port) = start_server(&args);
        let stock = answer(port);
        drop(stock_server);
        let stats = scratch().join("server-draft-stats.json");
        let mut budgeted = args.clone();
        budgeted.extend_from_slice(&["--ram-budget", "1G", "--sdq-stats", stats.to_str().unwrap()]);
        let (server, port) = start_server_env(&budgeted, &[("SDQ_PRELOAD", "0")]);
        let paged = answer(port);
        let (_, metrics) = http(port, "GET", "/metrics", None).unwrap();
        assert!(stop(server).success());
        assert_eq!(paged, stock, "{flags:?}: answered unlike stock");
        let drafted = llamacpp_sample(&metrics, "spec_decode_num_draft_tokens_total");
        let accepted = llamacpp_sample(&metrics, "spec_decode_num_accepted_tokens_total");
        assert!(drafted > 0.0 && accepted > 0.0, "{flags:?}: {drafted} drafted, {accepted} accepted: nothing was drafted");
        let s: Value = read_json(&stats);
        assert!(s["paged"] == true && u(&s, "misses") > 0, "{flags:?}: {s}");
        eprintln!("{flags:?}: {drafted} drafted, {accepted} accepted, identical to stock");
    }
    // A draft model without routed experts (-md, --spec-type draft-simple):
    // its weights are held beside the paged model's, in the budget, and its
    // files never taken for the paged model's.
    let dense = TempModel::generate("draft-dense.gguf", &["--preset", "tiny", "--arch", "glm4moe", "--layers", "2", "--dense-layers", "2", "--nextn", "0"]);
    let mut args = vec!["-m", model, "--no-warmup", "--metrics", "-md", dense.to_str().unwrap(), "--spec-type", "draft-simple", "--spec-draft-n-max", "4"];
    let answer = |port: u16| -> Vec<String> { prompts.iter().map(|p| greedy(port, p, 32)).collect() };
    let (stock_server, port) = start_server(&args);
    let stock = answer(port);
    drop(stock_server);
    let stats = scratch().join("server-draft-model-stats.json");
    args.extend_from_slice(&["--ram-budget", "1G", "--sdq-stats", stats.to_str().unwrap()]);
    let (server, port) = start_server_env(&args, &[("SDQ_PRELOAD", "0")]);
    let paged = answer(port);
    let (_, metrics) = http(port, "GET", "/metrics", None).unwrap();
    assert!(stop(server).success());
    assert_eq!(paged, stock, "-md with a dense draft model: answered unlike stock");
    let (drafted, accepted) =
        (llamacpp_sample(&metrics, "spec_decode_num_draft_tokens_total"), llamacpp_sample(&metrics, "spec_decode_num_accepted_tokens_total"));
    assert!(drafted > 0.0 && accepted > 0.0, "-md: {drafted} drafted, {accepted} accepted");
    let s: Value = read_json(&stats);
    assert!(s["paged"] == true && u(&s, "misses") > 0 && u(&s, "peak_rss_anon_bytes") <= 1 << 30, "{s}");
}

/// A draft model with routed experts (`-md`) under a budget whose arena
/// holds about one and a half token cycles of both models: its experts are
/// paged beside the target's as the pager's layers after the target's, read
/// from its own file. The answers are stock's with the same flags, and so
/// are the drafts (the same tokens drafted and accepted: a draft read from
/// the wrong bytes would draft others). The warm-up is on, so the target's
/// warm-up runs before the draft loads (the arena is planned after both).
/// The draft is the target's weights with Q8_0 experts: other bytes at other
/// offsets, drafting tokens the target sometimes accepts.
#[test]
fn a_draft_model_with_experts_is_paged_beside_the_target() {
    let model = tiny().to_str().unwrap();
    let draft = TempModel::generate("draft-q8.gguf", &small_vocab(&["--preset", "tiny", "--seed", "1", "--expert-type", "q8_0"]));
    let draft = draft.to_str().unwrap();
    let prompts = ["The rivers and the mountains and the rivers", "Count: one two three four one two"];
    let args = ["-m", model, "-md", draft, "--spec-type", "draft-simple", "--spec-draft-n-max", "4", "--metrics"];
    let answer = |port: u16| -> (Vec<String>, f64, f64) {
        let text = prompts.iter().map(|p| greedy(port, p, 32)).collect();
        let (_, metrics) = http(port, "GET", "/metrics", None).unwrap();
        (text, llamacpp_sample(&metrics, "spec_decode_num_draft_tokens_total"), llamacpp_sample(&metrics, "spec_decode_num_accepted_tokens_total"))
    };
    let (stock_server, port) = start_server(&args);
    let stock = answer(port);
    drop(stock_server);
    assert!(stock.1 > 0.0 && stock.2 > 0.0, "stock drafted {} and accepted {}: the test drafts nothing", stock.1, stock.2);

    let probe_stats = scratch().join("server-moe-draft-probe.json");
    let (probe, _) = start_server(&[&args[..], &["--ram-budget", "20G", "--sdq-reserve", "64M", "--sdq-stats", probe_stats.to_str().unwrap()]].concat());
    assert!(stop(probe).success());
    let probe: Value = read_json(&probe_stats);
    // One token cycle of both models: each paged layer's top-k.
    let cycle: u64 = probe["layers"].as_array().unwrap().iter().map(|l| u(l, "expert_bytes") * u(&probe, "top_k")).sum();
    let budget = crate::pager::budget_for(&probe, 64 * crate::pager::MIB, cycle * 3 / 2);
    let stats = scratch().join("server-moe-draft-stats.json");
    let (server, port) = start_server_env(
        &[&args[..], &["--ram-budget", &budget, "--sdq-reserve", "64M", "--sdq-stats", stats.to_str().unwrap()]].concat(),
        &[("SDQ_PRELOAD", "0")],
    );
    let paged = answer(port);
    assert!(stop(server).success());
    assert_eq!(paged, stock, "-md with a draft model with experts: answered or drafted unlike stock (answers, drafted, accepted)");

    let s: Value = read_json(&stats);
    let models = s["models"].as_array().unwrap();
    assert!(models.len() == 2 && models[1]["path"] == draft, "{s}");
    let first_draft_layer = u(&models[1], "first_layer");
    assert_eq!(first_draft_layer, 8, "the tiny target has 8 paged layers: {s}");
    let looked_up = |l: &Value| u(l, "hits") + u(l, "misses");
    let layers = s["layers"].as_array().unwrap();
    let (target, draft_layers): (Vec<&Value>, Vec<&Value>) = layers.iter().partition(|l| u(l, "layer") < first_draft_layer);
    assert!(target.len() == 8 && draft_layers.len() == 8, "{s}");
    assert!(target.iter().chain(&draft_layers).all(|l| looked_up(l) > 0), "a layer was never looked up: {s}");
    assert!(draft_layers.iter().map(|l| u(l, "misses")).sum::<u64>() > 0 && u(&s, "arena_bytes") < u(&s, "expert_bytes_total"), "{s}");
    assert!(u(&s, "peak_rss_anon_bytes") <= budget.parse::<u64>().unwrap() && u(&s, "vm_swap_bytes") == 0, "{s}");

    // sdq inspect --model-draft counts the experts the run pages.
    let o = run(Command::new(bin("sdq")).args(["inspect", "--json", "--model-draft", draft, model]), 60);
    assert!(o.status.success(), "{}", stderr(&o));
    let inspect: Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(u(&inspect, "routed_expert_bytes"), u(&s, "expert_bytes_total"), "inspect --model-draft counts other experts than the run pages: {inspect}");
    assert_eq!(u(&inspect["draft"], "first_layer"), first_draft_layer, "{inspect}");
    eprintln!(
        "-md with experts: {} drafted, {} accepted, identical to stock; arena {} of {} expert bytes",
        paged.1,
        paged.2,
        u(&s, "arena_bytes"),
        u(&s, "expert_bytes_total")
    );

    // Tracing records one model's routing: with such a draft, one clear error.
    let trace = scratch().join("moe-draft.trace");
    let o = run(
        Command::new(bin("llama-server")).args([
            "-m",
            model,
            "-md",
            draft,
            "--port",
            &free_port().to_string(),
            "--ram-budget",
            "1G",
            "--sdq-trace",
            trace.to_str().unwrap(),
        ]),
        120,
    );
    let text = stderr(&o);
    assert!(o.status.code() == Some(1) && text.contains("--sdq-trace") && text.contains("-md") && !text.contains("panicked"), "{text}");
}

/// MTP drafting (`--spec-type draft-mtp`) on a generated qwen35moe with a
/// NextN block: under a budget whose arena holds about one and a half
/// token cycles, the answers are stock's with the same flags; the block's
/// experts are paged (its layer is in the stats) and counted as
/// `sdq inspect --spec-type draft-mtp` counts them. Random weights draft
/// tokens the trunk rarely accepts: the test is of the mechanics.
#[test]
fn mtp_drafting_under_a_budget_answers_as_stock() {
    let model = gen_model("tiny-mtp.gguf", &small_vocab(&["--preset", "tiny", "--seed", "1", "--nextn", "1"]));
    let model = model.to_str().unwrap();
    let prompts = ["The rivers and the mountains", "Count: one two three"];
    let args = ["-m", model, "--no-warmup", "--metrics", "--spec-type", "draft-mtp"];
    let answer = |port: u16| -> Vec<String> { prompts.iter().map(|p| greedy(port, p, 32)).collect() };
    let (stock_server, port) = start_server(&args);
    let stock = answer(port);
    drop(stock_server);

    let probe_stats = scratch().join("server-mtp-probe.json");
    let (probe, _) = start_server(&[&args[..], &["--ram-budget", "20G", "--sdq-reserve", "64M", "--sdq-stats", probe_stats.to_str().unwrap()]].concat());
    assert!(stop(probe).success());
    let probe: Value = read_json(&probe_stats);
    let budget = crate::pager::budget_for(&probe, 64 * crate::pager::MIB, 6 * crate::pager::MIB);
    let stats = scratch().join("server-mtp-stats.json");
    let (server, port) = start_server_env(
        &[&args[..], &["--ram-budget", &budget, "--sdq-reserve", "64M", "--sdq-stats", stats.to_str().unwrap()]].concat(),
        &[("SDQ_PRELOAD", "0")],
    );
    let paged = answer(port);
    let (_, metrics) = http(port, "GET", "/metrics", None).unwrap();
    assert!(stop(server).success());
    assert_eq!(paged, stock, "draft-mtp under a budget answered unlike stock");
    let drafted = llamacpp_sample(&metrics, "spec_decode_num_draft_tokens_total");
    assert!(drafted > 0.0, "nothing was drafted: {metrics}");

    let s: Value = read_json(&stats);
    assert!(u(&s, "misses") > 0, "{s}");
    let nextn = s["layers"].as_array().unwrap().iter().find(|l| u(l, "layer") == 8).unwrap_or_else(|| panic!("the NextN block (layer 8) is not paged: {s}"));
    assert!(u(nextn, "hits") + u(nextn, "misses") > 0, "the NextN block's experts were never looked up: {nextn}");
    let inspect = |extra: &[&str]| -> Value {
        let o = run(Command::new(bin("sdq")).args(["inspect", "--json"]).args(extra).arg(model), 60);
        assert!(o.status.success(), "{}", stderr(&o));
        serde_json::from_str(&stdout(&o)).unwrap()
    };
    let (with, without) = (inspect(&["--spec-type", "draft-mtp"]), inspect(&[]));
    assert_eq!(u(&with, "routed_expert_bytes"), u(&s, "expert_bytes_total"), "inspect --spec-type draft-mtp counts other experts than the run pages");
    assert!(u(&without, "routed_expert_bytes") < u(&with, "routed_expert_bytes") && with["nextn_loaded"] == true, "{without}");
    eprintln!("draft-mtp: {drafted} drafted, identical to stock; the NextN block's experts paged: {nextn}");
}

/// The chat page: where the build had npm (it built the pinned tree's
/// tools/ui into target/ui/dist), llama-server serves it at `/` as
/// upstream's release does (gzip, to a browser that accepts it), and
/// `--no-webui` turns it off; where the build left it out, `/` is 404.
#[test]
fn the_chat_page_is_served_at_the_root() {
    use std::io::{Read, Write};
    let built = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/ui/dist/index.html").is_file();
    let get_root = |port: u16| -> String {
        let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        write!(s, "GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nAccept-Encoding: gzip\r\nConnection: close\r\n\r\n").unwrap();
        let mut head = Vec::new();
        let _ = s.read_to_end(&mut head);
        let end = head.windows(4).position(|w| w == b"\r\n\r\n").unwrap_or(head.len());
        String::from_utf8_lossy(&head[..end]).to_lowercase()
    };
    let model = tiny().to_str().unwrap();
    let (server, port) = start_server(&["-m", model, "--no-warmup", "--ram-budget", "1G"]);
    let head = get_root(port);
    drop(server);
    if built {
        assert!(head.starts_with("http/1.1 200") && head.contains("content-type: text/html") && head.contains("content-encoding: gzip"), "{head}");
    } else {
        assert!(head.starts_with("http/1.1 404"), "{head}");
    }
    let (server, port) = start_server(&["-m", model, "--no-warmup", "--ram-budget", "1G", "--no-webui"]);
    let head = get_root(port);
    drop(server);
    assert!(head.starts_with("http/1.1 404"), "--no-webui: {head}");
}

/// Long prompts pasted into a chat, in batches of `-b 2048` (stock's default,
/// which sdq keeps when it is given; -ub 512, prompt caching on; a reserve of
/// 512 MiB, whose eighth holds a group of four staged ubatches of this
/// model) under a budget whose arena holds two layers' experts, not the
/// model's: each llama_decode batch of a prompt (the server cuts a prompt
/// into several: every 2,048 tokens and for its checkpoints) is computed
/// layer by layer across its ubatches, the answers are stock's,
/// the prompts read less than one ubatch at a time does (`SDQ_GROUP=1`),
/// the same conversation asked again reads nothing for its cached prompt,
/// `/metrics` and the stats file give the prompt's bytes read against its
/// touched experts' bytes, and so does a streamed prompt's progress after
/// each batch.
#[test]
fn long_chat_prompts_are_read_once_per_batch_and_answer_as_stock() {
    let model = tiny().to_str().unwrap();
    // Two texts of their own (the long one does not start with the short
    // one, which the prompt cache would reuse).
    let (short, long) = (common_words(1_800, 11), common_words(3_600, 12));
    let chat = |port: u16, text: &str| -> (String, Value) {
        let body = serde_json::json!({ "messages": [{ "role": "user", "content": text }], "max_tokens": 8, "top_k": 1, "temperature": 0 }).to_string();
        let (status, body) = http(port, "POST", "/v1/chat/completions", Some(&body)).expect("an answer within its timeout");
        assert_eq!(status, 200, "{body}");
        let v: Value = serde_json::from_str(&body).unwrap();
        (v["choices"][0]["message"]["content"].as_str().unwrap().to_string(), v["timings"].clone())
    };
    let args = ["-m", model, "-c", "4096", "-b", "2048", "--metrics"];
    let (stock_server, port) = start_server(&args);
    let stock: Vec<String> = [&short, &long].iter().map(|t| chat(port, t).0).collect();
    drop(stock_server);

    let probe_stats = scratch().join("server-long-probe.json");
    let (probe, port) = start_server(&[&args[..], &["--ram-budget", "2G", "--sdq-reserve", "512M", "--sdq-stats", probe_stats.to_str().unwrap()]].concat());
    chat(port, &short);
    assert!(stop(probe).success());
    let probe: Value = read_json(&probe_stats);
    let two_layers = 2 * all_arena(&probe, 16) / 8;
    let budget = crate::pager::budget_for(&probe, 512 * crate::pager::MIB, two_layers + crate::pager::MIB);
    // The two prompts and the short one again; what the prompts read, by /metrics and the stats file.
    let serve = |tag: &str, env: &[(&str, &str)]| -> (Vec<String>, f64, Value) {
        let stats = scratch().join(format!("server-long-{tag}.json"));
        let (server, port) =
            start_server_env(&[&args[..], &["--ram-budget", &budget, "--sdq-reserve", "512M", "--sdq-stats", stats.to_str().unwrap()]].concat(), env);
        let (first, _) = chat(port, &short);
        let (_, metrics) = http(port, "GET", "/metrics", None).unwrap();
        let read = sample(&metrics, "sdq_prompt_read_bytes_total");
        assert!(read > 0.0 && sample(&metrics, "sdq_prompt_touched_bytes_total") > 0.0, "{tag}: {metrics}");
        let (again, timings) = chat(port, &short);
        assert!(timings["prompt_n"].as_u64().unwrap() <= 4, "{tag}: the cached prompt was computed again: {timings}");
        let (_, metrics) = http(port, "GET", "/metrics", None).unwrap();
        // What the cached prompt's few new tokens read: at most a layer's experts each way.
        assert!(sample(&metrics, "sdq_prompt_read_bytes_total") - read <= two_layers as f64, "{tag}: a prompt-cache hit read again:\n{metrics}");
        let (second, progress) = streamed_chat_progress(port, &long);
        check_prompt_progress(tag, &progress);
        let (_, metrics) = http(port, "GET", "/metrics", None).unwrap();
        let total = sample(&metrics, "sdq_prompt_read_bytes_total");
        assert!(stop(server).success());
        let s: Value = read_json(&stats);
        assert_eq!(sample(&metrics, "sdq_prompt_groups_total"), u(&s["prompt_groups"], "groups") as f64, "{tag}: {s}");
        assert!(s["prompt"]["touched_bytes"].as_u64().unwrap() > 0, "{tag}: {s}");
        (vec![first, again, second], total, s)
    };
    let (grouped, grouped_read, s) = serve("grouped", &[]);
    let (groups, ubatches) = (u(&s["prompt_groups"], "groups"), u(&s["prompt_groups"], "ubatches"));
    assert!(groups >= 2 && ubatches > groups, "the prompts' batches were not computed in groups of several ubatches: {s}");
    let (one_at_a_time, alone_read, s) = serve("one-at-a-time", &[("SDQ_GROUP", "1")]);
    assert_eq!(u(&s["prompt_groups"], "groups"), 0, "{s}");
    let expect = vec![stock[0].clone(), stock[0].clone(), stock[1].clone()];
    assert_eq!((&grouped, &one_at_a_time), (&expect, &expect), "answers under the budget differ from stock's");
    assert!(grouped_read < 0.9 * alone_read, "grouped, the prompts read {grouped_read} bytes; one ubatch at a time, {alone_read}");
    eprintln!("long chat prompts: read {:.1} MiB grouped, {:.1} MiB one ubatch at a time", grouped_read / 1048576.0, alone_read / 1048576.0);
}

/// llama-server at its default flags (no `-c`: the model's 4,096; `-b` not
/// given) under a budget whose arena holds two layers' experts: sdq raises
/// `-b` to the context, so a long prompt alone in its batch is one
/// `llama_decode` past stock's 2,048 (its checkpoints taken inside it, where
/// stock ends a batch at each), reads less than at `-b 2048`, and is answered
/// as stock answers it with the same flags. Beside another request's decode
/// a batch holds stock's 2,048 tokens, so that request goes on between the
/// prompt's pieces.
#[test]
fn a_long_prompt_alone_is_one_batch_and_beside_a_decode_is_cut_as_stock() {
    let model = tiny().to_str().unwrap();
    let long = common_words(3_600, 12);
    // The tokens each batch of a streamed prompt computed: the steps of its progress.
    let batches = |progress: &[Value]| -> Vec<u64> { progress.windows(2).map(|w| u(&w[1], "processed") - u(&w[0], "processed")).filter(|&n| n > 0).collect() };
    let (stock_server, port) = start_server(&["-m", model]);
    let (stock, progress) = streamed_chat_progress(port, &long);
    drop(stock_server);
    let stock_batches = batches(&progress);
    assert!(stock_batches.iter().max() == Some(&2048), "stock's batches: {stock_batches:?}");

    let probe_stats = scratch().join("server-lone-probe.json");
    let (probe, port) = start_server(&["-m", model, "--ram-budget", "2G", "--sdq-reserve", "512M", "--sdq-stats", probe_stats.to_str().unwrap()]);
    streamed_chat_progress(port, "a short question");
    assert!(stop(probe).success());
    let probe: Value = read_json(&probe_stats);
    let budget = crate::pager::budget_for(&probe, 512 * crate::pager::MIB, 2 * all_arena(&probe, 16) / 8 + crate::pager::MIB);
    let serve = |tag: &str, extra: &[&str]| -> (String, Vec<u64>, Value) {
        let stats = scratch().join(format!("server-lone-{tag}.json"));
        let args = [&["-m", model, "--ram-budget", &budget, "--sdq-reserve", "512M", "--sdq-stats", stats.to_str().unwrap()][..], extra].concat();
        let (server, port) = start_server(&args);
        let (answer, progress) = streamed_chat_progress(port, &long);
        check_prompt_progress(tag, &progress);
        assert!(stop(server).success());
        (answer, batches(&progress), read_json(&stats))
    };
    let (whole, whole_steps, s) = serve("default", &[]);
    assert_eq!(whole, stock, "one batch against stock with the same flags");
    // One batch, one group; its progress is sent as its pieces are computed.
    assert_eq!(u(&s["prompt_groups"], "groups"), 1, "sdq did not make the prompt one group: {s}");
    assert!(u(&s["prompt_groups"], "ubatches") > 4, "the group holds no more than stock's -b: {s}");
    assert!(whole_steps.len() >= 4 && whole_steps.iter().all(|&n| n < 2048), "the one batch's progress came in steps of {whole_steps:?}");
    assert!(u(&s, "arena_bytes") < all_arena(&s, 16), "the arena holds every expert: {s}");
    let (cut, cut_batches, c) = serve("b2048", &["-b", "2048"]);
    assert_eq!(cut, stock, "-b 2048 against stock");
    // Stock's batches of 2,048, but the last: its checkpoint tail is in it
    // (the rest of the prompt fits the -b given), no batch past 2,048.
    let n = stock_batches.len();
    let merged: Vec<u64> = stock_batches[..n - 3].iter().copied().chain([stock_batches[n - 3..].iter().sum()]).collect();
    assert_eq!(cut_batches, merged, "-b 2048 cut the prompt otherwise than stock (its batches {stock_batches:?})");
    let (read, cut_read) = (u(&s["prompt"], "bytes_read") as f64, u(&c["prompt"], "bytes_read") as f64);
    assert!(read < 0.9 * cut_read, "one batch read {read} B, -b 2048 {cut_read} B");

    // Beside a decode: one request generates (its tokens in every batch)
    // while the long prompt comes; each of the prompt's batches then holds
    // at most stock's 2,048 tokens (an arena of every expert: which batches
    // are cut where does not depend on it).
    let (server, port) = start_server(&["-m", model, "-c", "8192", "--ram-budget", "1G", "--sdq-reserve", "512M"]);
    let talker = std::thread::spawn(move || {
        let body = serde_json::json!({ "messages": [{ "role": "user", "content": "Tell a long story." }], "max_tokens": 3000, "ignore_eos": true, "top_k": 1 });
        http(port, "POST", "/v1/chat/completions", Some(&body.to_string()))
    });
    wait_processing(port, || talker.is_finished());
    let (_, progress) = streamed_chat_progress(port, &long);
    let beside = batches(&progress);
    assert!(!talker.is_finished(), "the other request ended before the prompt did: nothing was beside it");
    drop(server);
    let _ = talker.join();
    assert!(beside.len() >= 3 && beside.iter().all(|&n| n <= 2048), "beside a decode, the prompt's batches: {beside:?}");
    eprintln!("a long prompt's batches: stock {stock_batches:?}, beside a decode {beside:?}; alone one batch, its progress in {} steps; read {:.1} MiB as one batch, {:.1} MiB at -b 2048", whole_steps.len(), read / 1048576.0, cut_read / 1048576.0);
}

/// A long prompt alone in its batch at llama-server's default flags, on a
/// model whose memory cannot be rolled back (Qwen3.5's recurrent layers,
/// gpt-oss's sliding window): stock ends a batch where each of its
/// checkpoints is due (516 and 4 tokens before the prompt's end), and each
/// batch reads the experts again; sdq keeps one batch, computed as one
/// group, and takes the checkpoints inside it. Two later prompts that
/// differ from it inside its last 4 and its last 516 tokens restore those
/// checkpoints on Qwen3.5 (each computes only what follows one) and, with
/// the first, get stock's text and top probabilities. (gpt-oss's window
/// cache holds 768 cells, more than the last 516 tokens, so there stock and
/// sdq alike roll those prompts back without a checkpoint: what is checked
/// is the cache the one batch left.)
#[test]
fn a_lone_prompts_checkpoints_are_taken_inside_its_one_batch() {
    let first = common_words(2_600, 21);
    let words: Vec<&str> = first.split(' ').collect();
    // The last word changed (after the checkpoint 4 tokens before the end),
    // and a word 120 before the end (after the one 516 before it).
    let mut last = words.clone();
    *last.last_mut().unwrap() = if words[words.len() - 1] == "river" { "stone" } else { "river" };
    let mut inside = words.clone();
    let k = words.len() - 120;
    inside[k] = if words[k] == "river" { "stone" } else { "river" };
    let prompts = [first.clone(), last.join(" "), inside.join(" ")];
    let ask = |port: u16, prompt: &str| -> (String, u64) {
        let body = serde_json::json!({ "prompt": prompt, "n_predict": 4, "top_k": 1, "n_probs": 4 }).to_string();
        let (status, body) = http(port, "POST", "/completion", Some(&body)).expect("an answer within its timeout");
        assert_eq!(status, 200, "{body}");
        let v: Value = serde_json::from_str(&body).unwrap();
        (format!("{} {}", v["content"], v["completion_probabilities"]), u(&v["timings"], "prompt_n"))
    };
    for (name, model, restores) in [("qwen35moe", tiny().to_path_buf(), true), ("gpt-oss", crate::families::family_model("gpt-oss"), false)] {
        let model = model.to_str().unwrap();
        let (stock_server, port) = start_server(&["-m", model, "--no-warmup"]);
        let stock: Vec<(String, u64)> = prompts.iter().map(|p| ask(port, p)).collect();
        drop(stock_server);
        // Each later prompt computed again only what follows a checkpoint
        // (with restores; else what follows where it differs).
        let computed: Vec<u64> = stock.iter().map(|a| a.1).collect();
        let third = if restores { computed[2] > 120 && computed[2] <= 600 } else { computed[2] <= 121 };
        assert!(computed[0] > 2048 + 516 && computed[1] <= 8 && third, "{name}: stock computed {computed:?} tokens");

        let probe_stats = scratch().join(format!("server-cuts-{name}-probe.json"));
        let (probe, port) =
            start_server(&["-m", model, "--no-warmup", "--ram-budget", "2G", "--sdq-reserve", "512M", "--sdq-stats", probe_stats.to_str().unwrap()]);
        ask(port, "a short question");
        assert!(stop(probe).success());
        let probe: Value = read_json(&probe_stats);
        let layers: u64 = probe["slot_classes"].as_array().unwrap().iter().map(|c| u(c, "layers")).sum();
        let budget = crate::pager::budget_for(&probe, 512 * crate::pager::MIB, 2 * all_arena(&probe, 16) / layers + crate::pager::MIB);
        let stats = scratch().join(format!("server-cuts-{name}.json"));
        let (server, port) =
            start_server(&["-m", model, "--no-warmup", "--metrics", "--ram-budget", &budget, "--sdq-reserve", "512M", "--sdq-stats", stats.to_str().unwrap()]);
        let one = ask(port, &prompts[0]);
        let (_, metrics) = http(port, "GET", "/metrics", None).unwrap();
        let (groups, read, touched) =
            (sample(&metrics, "sdq_prompt_groups_total"), sample(&metrics, "sdq_prompt_read_bytes_total"), sample(&metrics, "sdq_prompt_touched_bytes_total"));
        let rest: Vec<(String, u64)> = prompts[1..].iter().map(|p| ask(port, p)).collect();
        assert!(stop(server).success());
        let s: Value = read_json(&stats);
        assert!(u(&s, "arena_bytes") < all_arena(&s, 16), "{name}: the arena holds every expert: {s}");
        let answers: Vec<(String, u64)> = std::iter::once(one).chain(rest).collect();
        assert_eq!(answers, stock, "{name}: the three prompts (and the tokens each computed) against stock with the same flags");
        assert_eq!(groups, 1.0, "{name}: the first prompt was not one group:\n{metrics}");
        assert!(read <= 1.1 * touched, "{name}: the first prompt read {read} B of {touched} B touched");
        eprintln!("{name}: a lone prompt's checkpoints inside its batch: read {:.1} of {:.1} MiB touched", read / 1048576.0, touched / 1048576.0);
    }
}

/// A streamed chat completion asking the prompt's progress
/// (`return_progress`): its text and its `prompt_progress` objects in order.
fn streamed_chat_progress(port: u16, text: &str) -> (String, Vec<Value>) {
    let body = serde_json::json!({ "messages": [{ "role": "user", "content": text }], "max_tokens": 8, "top_k": 1, "temperature": 0,
        "stream": true, "return_progress": true });
    let (events, _) = crate::endpoints::chat_events(port, &body);
    let progress = events.iter().filter_map(|v| v.get("prompt_progress").cloned()).collect();
    (crate::endpoints::streamed_content(&events), progress)
}

/// A prompt of several batches, or of one that sdq made of it, streams its
/// progress after each batch or as the one computes, with sdq's figures
/// beside llama-server's: the prompt's tokens so far (sdq's are those its
/// ubatches begun: at least the server's processed less its cached, but the
/// first, and no more than the prompt), and bytes read and touched that
/// grow with it; zeros in the event sent before it begins.
fn check_prompt_progress(tag: &str, progress: &[Value]) {
    let mid: Vec<&Value> = progress.iter().filter(|p| u(p, "processed") > u(p, "cache") && u(p, "processed") < u(p, "total")).collect();
    assert!(!mid.is_empty(), "{tag}: no progress before the prompt's end: {progress:?}");
    let mut last = (0, 0, 0);
    for p in progress {
        let sdq = p.get("sdq").unwrap_or_else(|| panic!("{tag}: no sdq figures in the prompt's progress {p}"));
        let now = (u(sdq, "tokens"), u(sdq, "read_bytes"), u(sdq, "touched_bytes"));
        // The first, sent before anything is computed: zeros, not the
        // figures of the prompt before (or of the warm-up).
        if u(p, "processed") == u(p, "cache") {
            assert_eq!(now, (0, 0, 0), "{tag}: the prompt's figures before it began: {p}");
            continue;
        }
        // The server computes a prompt's first token alone, a step sdq
        // counts as decode (one token).
        let computed = u(p, "processed") - u(p, "cache");
        assert!(now.0 <= u(p, "total") - u(p, "cache") && now.0 + 1 >= computed, "{tag}: sdq's tokens are not the server's: {p}");
        assert!(now.0 == 0 || (now.1 > 0 && now.2 > 0), "{tag}: a prompt under way read nothing: {p}");
        assert!(now.0 >= last.0 && now.1 >= last.1 && now.2 >= last.2, "{tag}: the figures went back: {progress:?}");
        last = now;
    }
}

/// A read that fails for good inside a prompt whose ubatches are computed
/// together (layer by layer across the batch) fails that request with the
/// read's error, not the server; the whole batch's positions are dropped,
/// and the same prompt asked again is answered as stock answers it.
#[test]
fn a_failed_read_inside_a_grouped_prompt_fails_that_request_only() {
    let model = tiny().to_str().unwrap();
    let text: Vec<&str> = (0..1800).map(|i| ["the", "red", "sea", "old", "town", "light", "stone", "river"][(i * 7 + i / 3) % 8]).collect();
    let body = serde_json::json!({ "prompt": text.join(" "), "n_predict": 8, "top_k": 1, "cache_prompt": false }).to_string();
    let args = ["-m", model, "-c", "4096", "--no-warmup"];
    let (stock_server, port) = start_server(&args);
    let (code, stock) = http(port, "POST", "/completion", Some(&body)).unwrap();
    assert_eq!(code, 200, "{stock}");
    drop(stock_server);
    let probe_stats = scratch().join("server-group-eio-probe.json");
    let (probe, port) = start_server(&[&args[..], &["--ram-budget", "2G", "--sdq-reserve", "512M", "--sdq-stats", probe_stats.to_str().unwrap()]].concat());
    assert_eq!(http(port, "POST", "/completion", Some(&body)).unwrap().0, 200);
    assert!(stop(probe).success());
    let probe: Value = read_json(&probe_stats);
    let budget = crate::pager::budget_for(&probe, 512 * crate::pager::MIB, 2 * all_arena(&probe, 16) / 8 + crate::pager::MIB);
    // Every read from the 60th on fails, inside the first prompt's group (one
    // of its 128 experts, each read once), until the test ends the fault:
    // how many reads the failed request issues after it is the scheduler's.
    let fault = scratch().join("server-group-eio.fault");
    std::fs::write(&fault, b"").unwrap();
    let stats = scratch().join("server-group-eio.json");
    let log = scratch().join("server-group-eio.log");
    let (mut server, port) = start_server_logged(
        &[&args[..], &["--ram-budget", &budget, "--sdq-reserve", "512M", "--sdq-stats", stats.to_str().unwrap()]].concat(),
        &[("SDQ_FAULT_READ", &format!("eio@60+,while={}", fault.display())), ("SDQ_READ_BACKOFF_MS", "1"), ("SDQ_PRELOAD", "0")],
        Some(&log),
    );
    let (code, failed) = http(port, "POST", "/completion", Some(&body)).unwrap();
    assert_eq!(code, 500, "{failed}");
    assert!(failed.contains("injected read fault: EIO on read ") && failed.contains("of layer"), "{failed}");
    std::fs::remove_file(&fault).unwrap();
    let (code, again) = http(port, "POST", "/completion", Some(&body)).unwrap();
    assert_eq!(code, 200, "{again}");
    let content = |b: &str| serde_json::from_str::<Value>(b).unwrap()["content"].as_str().unwrap().to_string();
    assert_eq!(content(&again), content(&stock), "the prompt asked again answered unlike stock");
    assert!(server.0.try_wait().unwrap().is_none(), "the server ended");
    assert!(stop(server).success());
    let s: Value = read_json(&stats);
    assert!(u(&s["prompt_groups"], "groups") >= 2 && u(&s, "read_failures") >= 1, "{s}");
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(!text.contains("panicked"), "{text}");
}
