//! Routing traces and `sdq replay`: a live run's trace, replayed at the live
//! run's arena size, gives the live run's counts; no policy beats the
//! offline optimum; the default policy beats LRU where LRU fails. And hot
//! sets: saved at exit, read back between steps.

use crate::util::*;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Command;

const MIB: u64 = 1 << 20;
const PROMPT: &str = "The history of the city began with a small harbour";

struct Live {
    stats: Value,
    trace: PathBuf,
}

/// `sdq eval` on the wide model with a trace, in `budget`, `threads`
/// threads, the policy `policy`, and `env`.
fn live(tag: &str, budget: &str, threads: u32, policy: &str, env: &[(&str, &str)]) -> Live {
    let dir = scratch();
    let (stats, trace) = (dir.join(format!("replay-{tag}.json")), dir.join(format!("replay-{tag}.csv")));
    let o = run(
        Command::new(bin("sdq"))
            .args(["eval", "-m", wide().to_str().unwrap(), "-p", PROMPT, "-n", "40", "-t", &threads.to_string()])
            .args(["--ram-budget", budget, "--sdq-reserve", "16M", "--sdq-policy", policy])
            .args(["--sdq-stats", stats.to_str().unwrap(), "--sdq-trace", trace.to_str().unwrap()])
            .envs(env.iter().copied()),
        300,
    );
    assert!(o.status.success(), "sdq eval {tag}: {}", stderr(&o));
    let stats = read_json(&stats);
    Live { stats, trace }
}

fn replay(trace: &Path, args: &[&str]) -> Value {
    let o = run(Command::new(bin("sdq")).arg("replay").arg(trace).args(args).arg("--json"), 120);
    assert!(o.status.success(), "sdq replay {args:?}: {}", stderr(&o));
    serde_json::from_str(&stdout(&o)).unwrap_or_else(|e| panic!("{e}: {}", stdout(&o)))
}

/// The replayed tally of `policy` in a replay's result `r`.
fn tally<'a>(r: &'a Value, policy: &str) -> &'a Value {
    r["policies"].as_array().unwrap().iter().find(|p| p["policy"] == policy).unwrap_or_else(|| panic!("no {policy} in {r}"))
}

#[test]
fn replay_reproduces_the_live_hit_rate() {
    // A probe learns what the process holds after load and the token cycle.
    let probe = live("probe", "2G", 2, "freq", &[]);
    let cycle = u(&replay(&probe.trace, &["--cycles", "1"]), "token_cycle_bytes");
    let after_load = held_after_load(&probe.stats);
    for (policy, threads, cycles) in
        [("freq-auto", 1, 1.0), ("lru", 1, 1.0), ("freq-auto", 1, 2.5), ("freq", 1, 2.5), ("freq-shares", 1, 2.5), ("reuse", 1, 1.0), ("freq-auto", 2, 1.0)]
    {
        // An arena of about `cycles` token cycles; 4 MiB of slack for the
        // anonymous memory after load, which varies a little between runs.
        let budget = (after_load + 16 * MIB + (cycles * cycle as f64) as u64 + 4 * MIB + if sanitized() { 128 * MIB } else { 0 }).to_string();
        let tag = format!("{policy}-{threads}t-{cycles}");
        // Prefetching reads what the live run predicts; the trace does not say what.
        let l = live(&tag, &budget, threads, policy, &[("SDQ_PREFETCH", "0")]);
        let s = &l.stats;
        let arena = u(s, "arena_bytes");
        assert!(arena as f64 > 0.9 * cycles * cycle as f64, "{tag}: arena {arena} for {cycles} cycles of {cycle}");
        assert!(u(s, "hits") > 0 && u(s, "misses") > 0, "{tag}: {s}");
        let r = &replay(&l.trace, &["--ram-budget", &arena.to_string(), "--policy", policy])["results"][0];
        let slots: Vec<u64> = r["slot_classes"].as_array().unwrap().iter().map(|c| u(c, "slots")).collect();
        let live_slots: Vec<u64> = s["slot_classes"].as_array().unwrap().iter().map(|c| u(c, "slots")).collect();
        assert_eq!(slots, live_slots, "{tag}: the replay plans the live arena");
        let t = tally(r, policy);
        eprintln!(
            "{tag}: live {} hits {} misses, replay {} / {}, Bélády {}",
            u(s, "hits"),
            u(s, "misses"),
            u(t, "hits"),
            u(t, "misses"),
            u(&r["belady"], "hits")
        );
        assert_eq!(u(t, "hits") + u(t, "misses"), u(s, "hits") + u(s, "misses"), "{tag}: lookups");
        // One compute thread takes a batch's experts in one order; two may
        // give an expert left without a slot a different victim.
        if threads == 1 {
            assert_eq!((u(t, "hits"), u(t, "misses")), (u(s, "hits"), u(s, "misses")), "{tag}: replay vs live");
        } else {
            let (live_pct, replay_pct) = (100.0 * s["hit_rate"].as_f64().unwrap(), t["hit_pct"].as_f64().unwrap());
            assert!((live_pct - replay_pct).abs() <= 1.0, "{tag}: live {live_pct:.2} % vs replay {replay_pct:.2} %");
        }
        assert_eq!(u(t, "bytes_read"), u(s, "bytes_read"), "{tag}: bytes read");
        assert!(u(t, "hits") <= u(&r["belady"], "hits"), "{tag}: above the optimum");
    }
}

#[test]
fn the_default_policy_beats_lru_at_one_token_cycle_and_never_loses_to_it() {
    let l = live("policies", "2G", 2, "freq-auto", &[]);
    let cycles = [0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0];
    let list = cycles.map(|c| c.to_string()).join(",");
    let report = replay(&l.trace, &["--cycles", &list, "--policy", "all"]);
    for (r, c) in report["results"].as_array().unwrap().iter().zip(cycles) {
        let pct = |p: &str| tally(r, p)["hit_pct"].as_f64().unwrap();
        let belady = r["belady"]["hit_pct"].as_f64().unwrap();
        eprintln!("{c} cycles: freq-auto {:.1} %, freq {:.1} %, lru {:.1} %, Bélády {belady:.1} %", pct("freq-auto"), pct("freq"), pct("lru"));
        assert!(pct("freq-auto") <= belady && pct("lru") <= belady, "{c} cycles: above the optimum: {r}");
        if c == 1.0 {
            // Measured +7.7 points (54.2 against 46.5 %).
            assert!(pct("freq-auto") >= pct("lru") + 5.0, "one token cycle: {r}");
        }
        if c >= 1.0 {
            assert!(pct("freq-auto") >= pct("lru") - 1.0, "{c} cycles: {r}");
        }
        // On a generated model's routing, freq over the whole class does well:
        // the default follows it within a point.
        assert!(pct("freq-auto") >= pct("freq") - 1.0, "{c} cycles: {r}");
    }
}

#[test]
fn traces_and_replays_refuse_bad_input_clearly() {
    // A trace needs the pager.
    let o = run(Command::new(bin("llama-completion")).args(completion_args(tiny(), "hi", 2)).args(["--sdq-trace", "/tmp/x.csv"]), 60);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("--sdq-trace needs --ram-budget"), "{}", stderr(&o));
    let o = run(Command::new(bin("llama-completion")).args(completion_args(tiny(), "hi", 2)).args(["--sdq-hotset", "/tmp/h.txt"]), 60);
    assert!(o.status.code() == Some(1) && stderr(&o).contains("--sdq-hotset needs --ram-budget"), "{}", stderr(&o));
    let o = run(Command::new(bin("sdq")).args(["eval", "-m", tiny().to_str().unwrap(), "-n", "2", "--sdq-trace", "/tmp/x.csv"]), 60);
    assert!(o.status.code() == Some(1) && stderr(&o).contains("--sdq-trace needs --ram-budget"), "{}", stderr(&o));
    // An unwritable trace fails before the model loads, naming the file.
    let o =
        run(Command::new(bin("llama-completion")).args(completion_args(tiny(), "hi", 2)).args(["--ram-budget", "2G", "--sdq-trace", "/nonexistent/t.csv"]), 60);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("cannot create trace file /nonexistent/t.csv"), "{}", stderr(&o));
    // Unknown policies list the known ones.
    let o = run(Command::new(bin("llama-completion")).args(completion_args(tiny(), "hi", 2)).args(["--ram-budget", "2G", "--sdq-policy", "mru"]), 60);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("--sdq-policy: unknown policy 'mru' (one of: freq-auto, freq-shares, freq, lru, reuse)"), "{}", stderr(&o));
    // A malformed trace names its file and line, without a backtrace.
    let bad = scratch().join("bad-trace.csv");
    std::fs::write(&bad, "# layer=0 bytes=100 experts=4\nstep,phase,layer,expert,weight\n0,d,0,1,0.5\n0,d,0,9,0.5\n").unwrap();
    let o = run(Command::new(bin("sdq")).arg("replay").arg(&bad).args(["--ram-budget", "1M"]), 60);
    assert_eq!(o.status.code(), Some(1));
    let e = stderr(&o);
    assert!(e.contains(&format!("{}:4: expert 9 of layer 0 is out of range (4 experts)", bad.display())) && !e.contains("panicked"), "{e}");
    // An arena below one layer's top-k says what it needs.
    std::fs::write(&bad, "# layer=0 bytes=100 experts=4\nstep,phase,layer,expert,weight\n0,d,0,1,0.5\n0,d,0,2,0.5\n").unwrap();
    let o = run(Command::new(bin("sdq")).arg("replay").arg(&bad).args(["--ram-budget", "4K"]), 60);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("cannot hold one layer's top-2 experts"), "{}", stderr(&o));
}

#[test]
fn a_hot_set_is_saved_at_exit_and_read_back_between_steps() {
    let dir = scratch();
    let hot = dir.join("hot.txt");
    let _ = std::fs::remove_file(&hot);
    // A budget with room for a few token cycles, so the arena keeps more than one token's experts.
    let probe = live("hot-probe", "2G", 2, "freq", &[]);
    let budget = (held_after_load(&probe.stats) + 16 * MIB + 24 * MIB + if sanitized() { 128 * MIB } else { 0 }).to_string();
    let eval = |tag: &str, hotset: bool| {
        let stats = dir.join(format!("hot-{tag}.json"));
        let mut cmd = Command::new(bin("sdq"));
        cmd.args(["eval", "-m", wide().to_str().unwrap(), "-p", PROMPT, "-n", "24", "--ram-budget", &budget, "--sdq-reserve", "16M"]);
        cmd.args(["--sdq-stats", stats.to_str().unwrap()]);
        if hotset {
            cmd.args(["--sdq-hotset", hot.to_str().unwrap()]);
        }
        let o = run(&mut cmd, 300);
        assert!(o.status.success(), "{tag}: {}", stderr(&o));
        let s: Value = read_json(&stats);
        (serde_json::from_str::<Value>(&stdout(&o)).unwrap()["tokens"].clone(), s)
    };
    let (cold_tokens, _) = eval("none", false);
    // First run: no file yet, a cold start; the arena's experts are saved at exit.
    let (tokens, first) = eval("first", true);
    assert_eq!(tokens, cold_tokens);
    assert_eq!(u(&first, "warm_start_listed"), 0);
    let text = std::fs::read_to_string(&hot).unwrap();
    let held: Vec<&str> = text.lines().filter(|l| l.ends_with(",1")).collect();
    assert!(text.starts_with("# sdq hot set\n# layer=0 bytes=") && held.len() > 8, "{text}");
    // A restarted server reads them while it waits for its first request:
    // that request then reads fewer experts, and answers the same.
    let server = |hotset: bool, tag: &str| {
        let stats = dir.join(format!("hot-server-{tag}.json"));
        let _ = std::fs::remove_file(&stats);
        let mut args = vec!["-m", wide().to_str().unwrap(), "-t", "2", "-c", "512", "-np", "1", "--ram-budget", "2G", "--sdq-stats", stats.to_str().unwrap()];
        if hotset {
            args.extend(["--sdq-hotset", hot.to_str().unwrap()]);
        }
        // Without the preload an arena that holds every expert would start.
        let (srv, port) = start_server_env(&args, &[("SDQ_PRELOAD", "0")]);
        let read = |key: &str| std::fs::read_to_string(&stats).ok().and_then(|t| serde_json::from_str::<Value>(&t).ok()).and_then(|v| v[key].as_u64());
        if hotset {
            stats_when(&stats, 60, "the hot set read while the server waited", |s| s["warm_start_pending"].as_u64() == Some(0));
            assert_eq!(read("warm_start_listed"), Some(held.len() as u64));
            assert!(read("warm_start_experts").unwrap() > 0);
        }
        let before = read("misses").unwrap_or(0);
        let body = format!(r#"{{"prompt": "{PROMPT}", "n_predict": 8, "temperature": 0, "cache_prompt": false}}"#);
        let (status, reply) = http(port, "POST", "/completion", Some(&body)).unwrap();
        assert_eq!(status, 200, "{reply}");
        // The stats file is rewritten each second: the next one counts the request.
        let answered = std::time::SystemTime::now();
        wait_until("the stats file rewritten after the request", 10, || std::fs::metadata(&stats).and_then(|m| m.modified()).ok().filter(|&t| t > answered));
        let misses = read("misses").unwrap() - before;
        drop(srv);
        (serde_json::from_str::<Value>(&reply).unwrap()["content"].clone(), misses)
    };
    let (cold_text, cold_misses) = server(false, "cold");
    let (warm_text, warm_misses) = server(true, "warm");
    assert_eq!(warm_text, cold_text, "a warm start changes no token");
    assert!(warm_misses < cold_misses, "the request missed {warm_misses} experts warm and {cold_misses} cold");
    // A malformed hot set stops the run before the model loads, naming the
    // file and line, and is left as it was.
    let with_hotset = || {
        let args = ["--ram-budget", &budget, "--sdq-reserve", "16M", "--sdq-hotset", hot.to_str().unwrap()];
        run(Command::new(bin("llama-completion")).args(completion_args(wide(), "hi", 2)).args(args), 60)
    };
    let bad = "# sdq hot set\n# layer=0 bytes=127488 experts=256\nlayer,expert,count,held\n0,300,1,1\n";
    std::fs::write(&hot, bad).unwrap();
    let o = with_hotset();
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains(&format!("{}:4: expert '300' of layer 0 is not below its 256 experts", hot.display())), "{}", stderr(&o));
    assert_eq!(std::fs::read_to_string(&hot).unwrap(), bad);
    // A hot set of another model is refused, naming what differs.
    std::fs::write(&hot, text.replacen("bytes=127488", "bytes=127489", 1)).unwrap();
    let o = with_hotset();
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("was saved for another model: layer 0 has 256 experts of 127489 bytes there and 256 of 127488 bytes in this model"),
        "{}",
        stderr(&o)
    );
}

/// The routing of a trained model (tests/fixtures/README.md): the only one
/// here; generated routing says little about real reuse.
fn trained_trace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/gemma-4-26b-a4b.trace.csv")
}

#[test]
fn on_a_trained_models_routing_the_default_policy_holds_its_share_of_the_gap() {
    let trace = trained_trace();
    // Cross-check with the trace's source, whose own replay found LRU 36.1 %
    // and Bélády 65.7 % of decode lookups at 1000 MiB (its accounting
    // differs in details: within 1.5 points).
    let r = replay(&trace, &["--ram-budget", "1000M"]);
    let at = &r["results"][0];
    let lru = tally(at, "lru")["decode_hit_pct"].as_f64().unwrap();
    let belady = at["belady"]["decode_hit_pct"].as_f64().unwrap();
    assert!((lru - 36.1).abs() < 1.5 && (belady - 65.7).abs() < 1.5, "lru {lru}, Bélády {belady}");

    // Never below LRU, and within half a point of freq, at every size from
    // 0.5 to 8 token cycles: on the whole trace, on its first half alone
    // (steps 0-64, written apart), and judged on its second (65-128) with
    // the first replayed before.
    let cycles = [0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0];
    let list = cycles.map(|c| c.to_string()).join(",");
    let first = scratch().join("trained-first-half.trace.csv");
    let text = std::fs::read_to_string(&trace).unwrap();
    let kept: Vec<&str> = text
        .lines()
        .filter(|l| !l.starts_with(|c: char| c.is_ascii_digit()) || l.split(',').next().and_then(|s| s.parse::<u64>().ok()).is_some_and(|s| s <= 64))
        .collect();
    std::fs::write(&first, kept.join("\n") + "\n").unwrap();
    let mut judged_shares = Vec::new();
    for (part, path, judged) in [("whole", &trace, "0"), ("first half", &first, "0"), ("second half", &trace, "65")] {
        let r = replay(path, &["--cycles", &list, "--judged-from", judged]);
        assert_eq!(r["judged_from_step"].as_u64(), Some(judged.parse().unwrap()));
        for (c, at) in cycles.iter().zip(r["results"].as_array().unwrap()) {
            let pct = |p: &str| tally(at, p)["decode_hit_pct"].as_f64().unwrap();
            let (d, l, f) = (pct("freq-auto"), pct("lru"), pct("freq"));
            assert!(d >= l, "{part}, {c} token cycles: the default policy's {d:.1} % is below LRU's {l:.1} %");
            assert!(d >= f - 0.5, "{part}, {c} token cycles: the default policy's {d:.1} % is more than half a point below freq's {f:.1} %");
            if judged == "65" && [1.0, 1.5, 2.0, 3.0, 4.0].contains(c) {
                judged_shares.push(tally(at, "freq-auto")["decode_gap_share_pct"].as_f64().unwrap());
            }
        }
    }
    let mean = judged_shares.iter().sum::<f64>() / judged_shares.len() as f64;
    eprintln!("default policy, judged on steps 65-128: shares of the LRU → Bélády gap at 1-4 token cycles {judged_shares:.1?}, mean {mean:.1} %");
    // Measured 32.1 % with token cycles counted in the arena's slots; 35.9 %
    // when they were counted in expert bytes, which put the arena at "1.0
    // cycles" one slot short of a token's experts, on LRU's cliff (LRU 29.5
    // against 35.6 %). It may rise, not fall.
    assert!(mean >= 31.7, "the default policy closes {mean:.1} % of the gap at 1-4 token cycles (was 32.1 %)");
}

/// `sdq inspect --trace` with another geometry's routing (the trained
/// trace on a generated model) is a projection: the trace replayed at the
/// same token cycles as the model's arena, its bytes per token scaled by
/// the two token cycles. Its held rate is `sdq replay`'s at those cycles.
#[test]
fn inspect_projects_a_trained_trace_onto_another_geometry() {
    let trace = trained_trace();
    let o = run(
        Command::new(bin("sdq"))
            .args(["inspect", "--json", "-c", "1024", "--ram-budget", "1G", "--sdq-reserve", "16M", "--read-rate", "800", "--trace"])
            .arg(&trace)
            .arg(wide()),
        60,
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let r: Value = serde_json::from_str(&stdout(&o)).unwrap();
    let (b, p) = (&r["budget"], &r["budget"]["prediction"]);
    assert_eq!(p["kind"], "projection", "{p}");
    let cycles = b["token_cycles_held"].as_f64().unwrap();
    let model_read = u(&r["token_working_set"], "token_read_bytes") as f64;
    let at = &replay(&trace, &["--ram-budget", &u(p, "replayed_arena_bytes").to_string(), "--policy", "freq-auto"])["results"][0];
    let replayed = tally(at, "freq-auto");
    let one_cycle = replay(&trace, &["--cycles", "1"]);
    let (trace_cycle, trace_read) = (u(&one_cycle, "token_cycle_bytes") as f64, u(&one_cycle, "token_read_bytes") as f64);
    assert!((u(p, "replayed_arena_bytes") as f64 / trace_cycle - cycles).abs() < 0.01, "replayed at {cycles:.3} cycles: {p}");
    assert!((p["decode_held_rate"].as_f64().unwrap() - replayed["decode_hit_pct"].as_f64().unwrap() / 100.0).abs() < 1e-9, "{p} vs {replayed}");
    let decode_steps = u(p, "decode_steps") as f64;
    let mib = u(replayed, "decode_bytes_read") as f64 / decode_steps * model_read / trace_read / MIB as f64;
    assert!((p["decode_mib_read_per_token"].as_f64().unwrap() - mib).abs() < 1e-6, "{p}: {mib}");
    assert!((p["read_bound_tokens_per_second"].as_f64().unwrap() - 800.0 / mib).abs() < 1e-6, "{p}");
    // The text report says it is a projection.
    let o = run(Command::new(bin("sdq")).args(["inspect", "-c", "1024", "--ram-budget", "1G", "--sdq-reserve", "16M", "--trace"]).arg(&trace).arg(wide()), 60);
    assert!(stdout(&o).contains("a projection: another geometry's routing"), "{}", stdout(&o));
    // Bad input: a trace with no budget, a missing trace, a bad read rate.
    for (args, msg) in [
        (&["--trace", trace.to_str().unwrap()][..], "--trace predicts for an arena: give --ram-budget too".to_string()),
        (&["--ram-budget", "1G", "--trace", "/nonexistent/t.csv"][..], "cannot open trace /nonexistent/t.csv".to_string()),
        (&["--ram-budget", "1G", "--trace", trace.to_str().unwrap(), "--read-rate", "0"][..], "--read-rate: '0' is not a positive MiB/s".to_string()),
    ] {
        let o = run(Command::new(bin("sdq")).arg("inspect").args(args).arg(wide()), 60);
        assert_eq!(o.status.code(), Some(1), "{args:?}");
        assert!(stderr(&o).contains(&msg) && !stderr(&o).contains("panicked"), "{args:?}: {}", stderr(&o));
    }
}

/// Decode hit % of LRU and Bélády at 0.5 to 8 token cycles.
fn curves(trace: &Path) -> Vec<f64> {
    // Not at exactly 1 cycle: there LRU's hit rate is a cliff that one slot
    // decides (the trained trace: 6.1 % at 0.95 cycles, 35.4 % at 1.00).
    let r = replay(trace, &["--cycles", "0.5,0.75,1.1,1.5,2,3,4,6,8", "--policy", "lru"]);
    let results = r["results"].as_array().unwrap();
    let lru = results.iter().map(|at| tally(at, "lru")["decode_hit_pct"].as_f64().unwrap());
    lru.chain(results.iter().map(|at| at["belady"]["decode_hit_pct"].as_f64().unwrap())).collect()
}

/// `sdq gen-model --routing trained` (issue 28, point 6): on the families
/// that run far past RAM and the target's, a generated model's greedy decode
/// replays close to the trained trace, and closer than the skewed default
/// (whose decode falls into a loop of a few tokens that any cache of 2 token
/// cycles holds). Measured (scripts/calibrate-routing.py, 16 layers, token
/// cycles in the arena's slots): largest difference over LRU and Bélády at
/// 0.5-8 cycles, on the mean of seeds 5-7, 3.4 points (qwen35moe), 3.4
/// (gpt-oss) and 3.9 (deepseek2).
#[test]
fn trained_routing_replays_closer_to_a_trained_models_routing() {
    let trained = curves(&trained_trace());
    let prompt = "Explain how a mixture-of-experts model decides which experts handle each token.";
    for arch in ["qwen35moe", "gpt-oss", "deepseek2"] {
        let mut distance = Vec::new();
        // The skewed default's distance (22-42 points, measured) is checked
        // on one architecture: the other two models would cost a minute.
        let routings: &[&str] = if arch == "qwen35moe" { &["trained", "skewed"] } else { &["trained"] };
        for &routing in routings {
            let tag = format!("routing-{arch}-{routing}");
            let model = TempModel::generate(
                &format!("{tag}.gguf"),
                &["--preset", "tiny", "--arch", arch, "--layers", "16", "--experts", "128", "--top-k", "6", "--seed", "5", "--routing", routing],
            );
            let trace = scratch().join(format!("{tag}.csv"));
            let o = run(
                Command::new(bin("sdq")).args(["eval", "-m", model.to_str().unwrap(), "-p", prompt, "-n", "128", "-c", "1024"]).args([
                    "--ram-budget",
                    "4G",
                    "--sdq-trace",
                    trace.to_str().unwrap(),
                ]),
                300,
            );
            assert!(o.status.success(), "sdq eval {tag}: {}", stderr(&o));
            let c = curves(&trace);
            let d = c.iter().zip(&trained).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
            eprintln!("{arch}, {routing} routing: LRU and Bélády {c:.1?} (trained {trained:.1?}): largest difference {d:.1} points");
            distance.push(d);
        }
        // Seed 5 measured 3.2, 2.6 and 6.8 points (qwen35moe, gpt-oss,
        // deepseek2); one seed's curves move by a few points, and the
        // calibration judges the mean of three (3.4, 3.4, 3.9).
        assert!(distance[0] <= 7.5, "{arch}: trained routing is {:.1} points from the trained trace", distance[0]);
        if let Some(&skewed) = distance.get(1) {
            assert!(distance[0] < skewed, "{arch}: trained routing is {:.1} points from the trained trace, skewed {skewed:.1}", distance[0]);
        }
    }
}

/// The trained trace's 157 tokens as a prompt of the first 140 in ubatches
/// of 32, then 17 decoded, written in the order `grouped` says: each
/// ubatch through every layer (one ubatch at a time), or each layer through
/// every ubatch (a prompt group, patch 0013). A batch is a step of one
/// ubatch (or token) at one layer, so either order replays as written.
fn trained_prompt_then_decode(grouped: bool) -> PathBuf {
    const PROMPT: usize = 140;
    const UBATCH: usize = 32;
    let text = std::fs::read_to_string(trained_trace()).unwrap();
    let (head, rows): (Vec<&str>, Vec<&str>) = text.lines().partition(|l| !l.starts_with(|c: char| c.is_ascii_digit()));
    // (step, layer) → rows in token order; step 0 is the trace's prompt,
    // top-6 rows a token.
    let mut by_batch: std::collections::BTreeMap<(u64, u32), Vec<(u32, &str)>> = Default::default();
    for r in &rows {
        let f: Vec<&str> = r.split(',').collect();
        by_batch.entry((f[0].parse().unwrap(), f[2].parse().unwrap())).or_default().push((f[3].parse().unwrap(), f[4]));
    }
    let layers: Vec<u32> = by_batch.keys().filter(|k| k.0 == 0).map(|k| k.1).collect();
    // A token: its (expert, weight) rows at each layer.
    type Token<'a> = Vec<&'a [(u32, &'a str)]>;
    let mut tokens: Vec<Token> = Vec::new();
    for t in 0..by_batch[&(0, layers[0])].len() / 6 {
        tokens.push(layers.iter().map(|l| &by_batch[&(0, *l)][6 * t..6 * t + 6]).collect());
    }
    let last = by_batch.keys().map(|k| k.0).max().unwrap();
    for s in 1..=last {
        tokens.push(layers.iter().map(|l| &by_batch[&(s, *l)][..]).collect());
    }
    let ubatches: Vec<&[Token]> = tokens[..PROMPT].chunks(UBATCH).collect();
    let mut out: Vec<String> = head.iter().map(|l| l.to_string()).collect();
    let batch = |step: usize, phase: &str, li: usize, toks: &[Token], out: &mut Vec<String>| {
        let mut seen = std::collections::HashSet::new();
        for (e, w) in toks.iter().flat_map(|t| t[li].iter()) {
            if seen.insert(*e) {
                out.push(format!("{step},{phase},{},{e},{w}", layers[li]));
            }
        }
    };
    // A step is a ubatch through every layer, or in a group a layer's ubatch.
    let mut step = 0;
    if grouped {
        for li in 0..layers.len() {
            for ub in &ubatches {
                batch(step, "p", li, ub, &mut out);
                step += 1;
            }
        }
    } else {
        for ub in &ubatches {
            for li in 0..layers.len() {
                batch(step, "p", li, ub, &mut out);
            }
            step += 1;
        }
    }
    for t in &tokens[PROMPT..] {
        for li in 0..layers.len() {
            batch(step, "d", li, std::slice::from_ref(t), &mut out);
        }
        step += 1;
    }
    let path = scratch().join(format!("trained-prompt-{}.trace.csv", if grouped { "grouped" } else { "one-at-a-time" }));
    std::fs::write(&path, out.join("\n") + "\n").unwrap();
    path
}

/// Issue 47: a prompt computed layer by layer across its ubatches runs a
/// layer's ubatches back to back, where every way of evicting keeps what
/// the ubatch before read. The default policy does not take those batches
/// as evidence of which way to follow, so the decode after a grouped
/// prompt hits as after one ubatch at a time (measured: 56.4, 77.1 and 94.4
/// % of its lookups at 2, 4 and 8 token cycles, against 56.3, 78.1 and
/// 94.2). Scored, they had it follow LRU into the decode: 50.1, 70.3 and
/// 87.3 %.
#[test]
fn the_decode_after_a_grouped_prompt_hits_as_after_one_ubatch_at_a_time() {
    let (one, grouped) = (trained_prompt_then_decode(false), trained_prompt_then_decode(true));
    let [one, grouped] = [one, grouped].map(|t| replay(&t, &["--cycles", "2,4,8", "--policy", "freq-auto"]));
    assert_eq!((one["prompt_steps"].as_u64(), one["decode_steps"].as_u64()), (Some(5), Some(17)));
    assert_eq!((grouped["prompt_steps"].as_u64(), grouped["decode_steps"].as_u64()), (Some(5 * 30), Some(17)));
    for (a, b) in one["results"].as_array().unwrap().iter().zip(grouped["results"].as_array().unwrap()) {
        let pct = |r: &Value| tally(r, "freq-auto")["decode_hit_pct"].as_f64().unwrap();
        let (o, g) = (pct(a), pct(b));
        eprintln!("{} token cycles: decode hits {o:.1} % after one ubatch at a time, {g:.1} % after the group", a["token_cycles"]);
        assert!(g >= o - 1.5, "{} token cycles: the decode after a grouped prompt hits {g:.1} %, after one ubatch at a time {o:.1} %", a["token_cycles"]);
    }
}
