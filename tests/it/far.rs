//! The geometries people run far past RAM, at full width and cut in depth:
//! gpt-oss-120b (128 MXFP4 experts of 13.2 MB per layer, a 201k vocabulary)
//! and DeepSeek-V3 (256 experts of 7168 × 2048, MLA, a dense leading layer),
//! the latter in split parts as such models ship. Under a budget each gives
//! stock's greedy tokens and logits with the same flags, and a budget below
//! one layer's top-k is one line naming the minimum.

use crate::pager::{budget_for, eval, long_prompt, max_abs_diff, MIB};
use crate::util::*;
use sdq::engine::model::gguf::Gguf;
use std::path::Path;
use std::process::Command;

/// Stock against the pager at the tightest arena (+8 MiB), with defaults
/// and `--no-repack`, and at a third of the experts with defaults.
fn check_against_stock(model: &Path, tag: &str, experts_per_layer: u64) {
    let prompt = "The river ran past the old mill, under the stone bridge where children watched";
    // The compute buffers' pages are touched after the arena is planned (at
    // the first paged layer): 6 MiB more for gpt-oss, 19 MiB for DeepSeek's
    // 128 heads at -c 512. The reserve is what covers that growth.
    let reserve = 64 * MIB;
    for (flags, extra) in [("defaults", &[][..]), ("no-repack", &["--no-repack"][..])] {
        let base = [&["-p", prompt, "-n", "12", "-t", "2", "-c", "512"][..], extra].concat();
        let stock = eval(model, &format!("{tag}-stock-{flags}"), &base);
        let probe = eval(model, &format!("{tag}-probe-{flags}"), &[&base[..], &["--ram-budget", "20G", "--sdq-reserve", "64M"]].concat());
        let stats = probe.stats.unwrap();
        let (all, min) = (all_arena(&stats, experts_per_layer), min_arena(&stats));
        // The minimum with 8 MiB to spare: what a run holds after load
        // varies by a few MiB from the probe's (malloc's arenas, pages the
        // first graph touches), and a slot here is 12.6-13.8 MiB, so the
        // arena still holds exactly one layer's top-k (checked below).
        // A third of the experts with stock's defaults only: the no-repack
        // path is the same code with plain kernels, which the minimum checks.
        let arenas: &[(&str, u64)] = if flags == "defaults" { &[("minimum", min + 8 * MIB), ("third", all / 3)] } else { &[("minimum", min + 8 * MIB)] };
        for &(name, arena) in arenas {
            let budget = budget_for(&stats, reserve, arena);
            let what = format!("{tag}: {name} arena, {flags}");
            let run = eval(model, &format!("{tag}-{name}-{flags}"), &[&base[..], &["--ram-budget", &budget, "--sdq-reserve", "64M"]].concat());
            assert_eq!(run.json["tokens"], stock.json["tokens"], "{what}: tokens differ from stock");
            assert_eq!(max_abs_diff(&run.logits, &stock.logits), 0.0, "{what}: logits differ");
            let s = run.stats.unwrap();
            assert!(sanitized() || u(&s, "peak_rss_anon_bytes") <= budget.parse().unwrap(), "{what}: peak RSS over budget: {s}");
            assert!(u(&s, "misses") > 0, "{what}: an arena smaller than the experts must miss: {s}");
            if name == "minimum" {
                let slots: Vec<u64> = s["slot_classes"].as_array().unwrap().iter().map(|c| u(c, "slots")).collect();
                assert!(slots.iter().all(|&n| n == u(&s, "top_k")), "{what}: not one layer's top-k: {slots:?}");
            }
            assert_eq!(s["vm_swap_bytes"].as_u64(), Some(0), "{what}: swapped");
        }
        if flags == "defaults" {
            // Less than one layer's top-k: refused before the first token.
            // (Half of it: what a run counts as held varies by a few MiB,
            // with the compute buffer pages touched before it plans.)
            let budget = budget_for(&stats, reserve, min / 2);
            let o = run(
                Command::new(bin("sdq")).args(["eval", "-m", model.to_str().unwrap()]).args(&base).args(["--ram-budget", &budget, "--sdq-reserve", "64M"]),
                300,
            );
            let err = stderr(&o);
            assert_eq!(o.status.code(), Some(1), "{tag}: a budget under the minimum: {err}");
            let line = err.lines().find(|l| l.contains("is too small")).unwrap_or_else(|| panic!("{tag}: no one-line error:\n{err}"));
            assert!(line.contains("the minimum budget is") && line.contains(&format!("top-{}", u(&stats, "top_k"))), "{tag}: {line}");
            assert!(!err.contains("panicked"), "{tag}: {err}");
        }
    }
}

#[test]
fn gpt_oss_120b_at_full_width_answers_as_stock() {
    let model = TempModel::generate("far-gpt-oss-120b-2l.gguf", &["--preset", "gpt-oss-120b", "--layers", "2"]);
    let g = Gguf::open(&model).unwrap();
    let experts: Vec<_> = g.tensors().into_iter().filter(|t| t.name.ends_with("_exps.weight")).collect();
    assert_eq!(experts.len(), 6);
    for t in &experts {
        assert_eq!(t.ty.name(), "mxfp4", "{}: gpt-oss ships MXFP4 experts", t.name);
        assert_eq!(t.ne[..3], [2880, 2880, 128], "{}", t.name);
    }
    check_against_stock(&model, "gpt-oss-120b", 128);
    inspect_predicts_the_live_run(&model, "gpt-oss-120b");
}

/// `sdq inspect --trace`: the model's own routing trace, replayed at the
/// arena a budget leaves, predicts the live run's decode held rate and MiB
/// read per token within 10 %. With prefetching off the replay is the run's
/// own accounting; with it on (the default) a wrong guess of the next
/// layer's experts evicts a little more, which the 10 % must cover at the
/// arena far past RAM leaves (about 3 token cycles for gpt-oss-120b in 8 GiB).
fn inspect_predicts_the_live_run(model: &Path, tag: &str) {
    let base = ["-p", "The history of the city began with a small harbour", "-n", "40", "-t", "2", "-c", "512"];
    let trace = scratch().join(format!("{tag}-own.csv"));
    let probe =
        eval(model, &format!("{tag}-trace"), &[&base[..], &["--ram-budget", "20G", "--sdq-reserve", "64M", "--sdq-trace", trace.to_str().unwrap()]].concat());
    let stats = probe.stats.unwrap();
    let classes = stats["slot_classes"].as_array().unwrap();
    let cycle: u64 = classes.iter().map(|c| u(c, "layers") * u(c, "expert_bytes")).sum::<u64>() * u(&stats, "top_k");
    // What a run holds after load moves by a few MiB from run to run; half
    // an expert more keeps the arena off a slot boundary, so that inspect
    // and the live run plan the same slots (one slot fewer at one token
    // cycle is LRU's cliff: 0.68 held against 0.88).
    let half_slot = classes.iter().map(|c| u(c, "expert_bytes")).max().unwrap() / 2;
    for (cycles, prefetch) in [(1.0, "0"), (3.0, "0"), (3.0, "1")] {
        let what = format!("{tag}: {cycles} token cycles, SDQ_PREFETCH={prefetch}");
        let budget = budget_for(&stats, 64 * MIB, (cycles * cycle as f64) as u64 + half_slot);
        let o = run(
            Command::new(bin("sdq"))
                .args(["inspect", "--json", "-c", "512", "-b", "512", "--ubatch-size", "512", "--ram-budget", &budget, "--sdq-reserve", "64M"])
                .args(["--trace", trace.to_str().unwrap()])
                .arg(model),
            120,
        );
        assert!(o.status.success(), "{what}: {}", stderr(&o));
        let r: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap();
        let p = &r["budget"]["prediction"];
        assert_eq!(p["kind"], "replay", "{what}: the model's own trace is replayed, not projected: {p}");
        let live = crate::pager::eval_env(
            model,
            &format!("{tag}-predicted-{cycles}-{prefetch}"),
            &[&base[..], &["--ram-budget", &budget, "--sdq-reserve", "64M"]].concat(),
            &[("SDQ_PREFETCH", prefetch)],
        );
        let live = live.stats.unwrap();
        let live_slots: Vec<u64> = live["slot_classes"].as_array().unwrap().iter().map(|c| u(c, "slots")).collect();
        let planned: Vec<u64> = r["budget"]["slots"].as_array().unwrap().iter().map(|c| u(c, "slots")).collect();
        assert_eq!(planned, live_slots, "{what}: inspect plans other slots than the live run");
        let d = &live["decode"];
        let close = |predicted: f64, measured: f64| (predicted - measured).abs() <= 0.1 * measured;
        let (held, mib) = (p["decode_held_rate"].as_f64().unwrap(), p["decode_mib_read_per_token"].as_f64().unwrap());
        let (live_held, live_mib) = (d["held_rate"].as_f64().unwrap(), d["mib_read_per_token"].as_f64().unwrap());
        eprintln!("{what}: predicted {held:.3} held, {mib:.1} MiB/token; live {live_held:.3}, {live_mib:.1}");
        assert!(
            close(held, live_held) && close(mib, live_mib),
            "{what}: predicted {held:.3} held and {mib:.1} MiB/token, live {live_held:.3} and {live_mib:.1}"
        );
        assert!(live_mib > 0.0, "{what}: an arena of {cycles} cycles must read: {d}");
    }
}

#[test]
fn deepseek_v3_at_full_width_in_split_parts_answers_as_stock() {
    // One dense layer and one of 256 experts at Q2_K (3.7 GB), in parts of
    // at most 2 GB of tensors: the expert tensors (1.2 GB each) fall in
    // parts of their own, apart from the first part's embeddings and dense
    // layer, and the last holds the down experts and the 760 MB output.
    let args = ["--preset", "deepseek-v3", "--layers", "2", "--dense-layers", "1", "--expert-type", "q2_K", "--split-max-size", "2G"];
    gen_model("far-deepseek-v3-2l.gguf", &args);
    assert!(!scratch().join("far-deepseek-v3-2l.gguf").exists(), "a split model is written in parts only");
    let first = scratch().join("far-deepseek-v3-2l-00001-of-00004.gguf");
    let count = Gguf::open(&first).unwrap().get("split.count").and_then(|v| v.as_u64()).unwrap_or_else(|| panic!("{}: no split.count", first.display()));
    assert_eq!(count, 4, "3.7 GB of experts and 1.8 GB of other weights in parts of 2 GB");
    let parts: Vec<TempModel> = (1..=count)
        .map(|i| scratch().join(format!("far-deepseek-v3-2l-{i:05}-of-{count:05}.gguf")))
        .inspect(|p| assert!(p.is_file(), "no part {}", p.display()))
        .map(TempModel::adopt)
        .collect();
    let mut tensors = 0;
    for (i, p) in parts.iter().enumerate() {
        let g = Gguf::open(p).unwrap();
        assert_eq!(g.get("split.no").and_then(|v| v.as_u64()), Some(i as u64));
        assert_eq!(g.get("split.count").and_then(|v| v.as_u64()), Some(count));
        assert_eq!(g.get("general.architecture").is_some(), i == 0, "only the first part carries the model's keys");
        tensors += g.tensors().len() as u64;
    }
    assert_eq!(Gguf::open(&parts[0]).unwrap().get("split.tensors.count").and_then(|v| v.as_u64()), Some(tensors));
    check_against_stock(&parts[0], "deepseek-v3", 256);
}

/// DeepSeek's 128 heads at `-c 4096` and a 512-token ubatch fill 445 MiB of
/// compute buffers, and a prompt touches all of them, though the share that
/// would give every token its logits (252 MiB) is never written: ggml lays a
/// graph's tensors out anew for each graph. The arena is planned beside what
/// a graph asking one output places in them, so a budget whose arena holds a
/// fraction of the experts is kept through a full prompt ubatch, inside a
/// memory limit of the budget itself (page cache counted). Narrow experts
/// (FFN 512) keep the file at 3.7 GB; two layers of them, so that the first
/// paged layer sees the whole ubatch (the last layer computes only the
/// outputs' rows). The prompt's two ubatches are one group sharing its
/// expert ops, the arena lending it what it stages and keeps.
#[test]
fn deepseek_v3_prompt_ubatch_stays_in_the_budget() {
    let args = ["--preset", "deepseek-v3", "--layers", "3", "--dense-layers", "1", "--expert-ff", "512", "--expert-type", "q2_K"];
    let model = TempModel::generate("far-deepseek-v3-narrow.gguf", &args);
    let prompt = long_prompt();
    let completion = |budget: &str, stats: &Path| -> Vec<String> {
        let args = ["-n", "2", "--top-k", "1", "-no-cnv", "-t", "2", "-c", "4096", "-ub", "512", "--sdq-reserve", "64M", "--ram-budget", budget];
        [bin("llama-completion").to_str().unwrap(), "-m", model.to_str().unwrap(), "-f", prompt.to_str().unwrap(), "--sdq-stats", stats.to_str().unwrap()]
            .into_iter()
            .chain(args)
            .map(String::from)
            .collect()
    };
    let probe_stats = scratch().join("deepseek-v3-narrow-probe.json");
    let probe = completion("20G", &probe_stats);
    let o = run(Command::new(&probe[0]).args(&probe[1..]), 600);
    assert!(o.status.success(), "probe: {}", stderr(&o));
    let probe = read_json(&probe_stats);
    assert!(u(&probe, "compute_untouched_bytes") > 400 * MIB, "the compute buffers a prompt touches were not all counted: {probe}");
    // An arena of 400 MiB: a fifth of the experts, all its pages faulted in
    // before the first token (`SDQ_POPULATE=1`), so that the limit meets the
    // whole arena. The default faults in at idle priority, just ahead of
    // the fills, and on a busy machine may be short of the arena when so
    // short a run ends.
    let budget = budget_for(&probe, 64 * MIB, 400 * MIB);
    let (stats, report) = (scratch().join("deepseek-v3-narrow.json"), scratch().join("deepseek-v3-narrow-limit.json"));
    let o = run(
        Command::new(bin("sdq"))
            .env("SDQ_POPULATE", "1")
            .args(["limit", "--memory", &budget, "--report", report.to_str().unwrap(), "--"])
            .args(completion(&budget, &stats)),
        600,
    );
    let r = read_json(&report);
    assert!(o.status.success(), "a 512-token ubatch in a budget of {budget} and a limit of as much: {r}\n{}", stderr(&o));
    if r["enforced"] == true {
        assert_eq!(r["oom_kills"].as_u64(), Some(0), "{r}");
    } else {
        eprintln!("the limit is not enforced here ({}): the budget alone is checked", r["mode"]);
    }
    let s = read_json(&stats);
    assert!(u(&s["prompt"], "tokens") >= 512, "not a full ubatch: {s}");
    // A group may stage in half the reserve, 32 MiB, and a ubatch here
    // stages 31 MiB: not two. But the arena holds less than a layer's
    // experts, so the group's ubatches share their expert ops, and the
    // arena lends it the rest (its slots past two layers' top-k), within
    // the limit. The slots it lent are faulted in again as they fill.
    let g = &s["prompt_groups"];
    assert!(u(g, "groups") == 1 && u(g, "shared") == 1 && u(g, "arena_lent_bytes") > 0, "the group was not shared and lent its room: {s}");
    assert!(
        u(&s, "arena_resident_bytes") + u(g, "arena_lent_bytes") + 16 * MIB >= u(&s, "arena_bytes"),
        "the arena's pages must all be resident, but for what it lent: {s}"
    );
    assert!(sanitized() || u(&s, "peak_rss_anon_bytes") <= budget.parse().unwrap(), "peak RSS over the budget of {budget}: {s}");
}
