#!/usr/bin/env python3
"""Decode from a cold start inside an enforced limit: the user's first minute.

Each run is `scripts/check-8g`'s command (llama-completion, a 10-token prompt,
64 greedy tokens or --tokens N, -ub 128) under `sdq limit --memory B` with --ram-budget B,
page cache dropped first, so the arena starts empty and decode pays for every
first use of an expert. Configurations:
  sdq            this build
  sdq-noprefetch this build with SDQ_PREFETCH=0
  sdq-populate   this build with SDQ_POPULATE=1 (arena faulted in before the
                 first token; the populate time is part of prompt time)
  sdq-nopopulate this build with SDQ_POPULATE=0 (each fresh slot faulted in
                 inside the read that fills it)
  sdq-lru        this build with SDQ_POLICY=lru (the default policy is freq-auto)
  sdq-freq       this build with SDQ_POLICY=freq (the default before issue 18)
  sdq-shares     this build with SDQ_POLICY=freq-shares
  sdq-thp        this build with SDQ_HUGEPAGES=auto (the arena on transparent huge pages)
  sdq-thp-ahead  SDQ_HUGEPAGES=auto SDQ_POPULATE=ahead (populated just ahead of the fills)
  sdq-thp-nopopulate  SDQ_HUGEPAGES=auto SDQ_POPULATE=0
  sdq-4k         SDQ_HUGEPAGES=0 SDQ_POPULATE=idle (the arena as it was before issue 20:
                 4 KiB pages, all of it populated at idle priority)
  sdq-4k-ahead   SDQ_HUGEPAGES=0 SDQ_POPULATE=ahead
  sdq-never      SDQ_HUGEPAGES=auto (and the default populater) with transparent
                 huge pages set to `never` for the run (root; sysfs restored
                 after): the fallback
  sdq-before     an earlier build (--before-bin DIR, its target/release)
Runs alternate between configurations (run 1 of each, then run 2, ...), so
the machine's drift hits all of them alike; the table gives medians and the
ratios of medians to the reference configuration (--reference, default
sdq-before), from the same invocation. Decode and prompt
speeds are llama.cpp's own (`common_perf_print`); the stats file gives hits,
misses, prefetches and bytes read. The output text of every run must equal
the first run's of the same build (this one, or --before-bin's), or the
script fails.

Writes NAME.json, NAME.md and (with matplotlib) NAME.png into --out.

Usage: scripts/bench-decode.py [--budgets 2,4,8] [--runs 3] [--threads 2] [--tokens 64]
                            [--configs sdq,sdq-noprefetch,sdq-before]
                            [--before-bin DIR] [--reference CONFIG]
                            [--out docs/bench] [--name decode] [--replot]
"""
import argparse
import datetime
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402 (scripts/benchlib.py)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.join(ROOT, "target", "release")
PROMPT = "The history of the city began with a small harbour"
CONFIGS = ["sdq", "sdq-thp", "sdq-thp-ahead", "sdq-thp-nopopulate", "sdq-4k", "sdq-4k-ahead", "sdq-never", "sdq-lru", "sdq-freq", "sdq-shares",
           "sdq-noprefetch", "sdq-populate", "sdq-nopopulate", "sdq-before"]
# The environment each configuration sets (over the build's defaults).
CONFIG_ENV = {
    "sdq-thp": {"SDQ_HUGEPAGES": "auto"},
    "sdq-thp-ahead": {"SDQ_HUGEPAGES": "auto", "SDQ_POPULATE": "ahead"},
    "sdq-thp-nopopulate": {"SDQ_HUGEPAGES": "auto", "SDQ_POPULATE": "0"},
    "sdq-4k": {"SDQ_HUGEPAGES": "0", "SDQ_POPULATE": "idle"},
    "sdq-4k-ahead": {"SDQ_HUGEPAGES": "0", "SDQ_POPULATE": "ahead"},
    "sdq-never-inner": {"SDQ_HUGEPAGES": "auto"},
    "sdq-lru": {"SDQ_POLICY": "lru"},
    "sdq-freq": {"SDQ_POLICY": "freq"},
    "sdq-shares": {"SDQ_POLICY": "freq-shares"},
    "sdq-noprefetch": {"SDQ_PREFETCH": "0"},
    "sdq-populate": {"SDQ_POPULATE": "1"},
    "sdq-nopopulate": {"SDQ_POPULATE": "0"},
}
THP = "/sys/kernel/mm/transparent_hugepage/enabled"


def drop_page_cache():
    return benchlib.drop_page_cache("bench-decode", "runs would not start cold", fatal=True)


def speed(err, what):
    """tokens/s from llama.cpp's timing line, e.g.
    'common_perf_print:        eval time = 9000.00 ms / 63 runs ( ... 7.00 tokens per second)'."""
    m = re.search(rf"(?<![a-z] ){what} time =.*?([0-9.]+) tokens per second", err)
    return float(m.group(1)) if m else None


def ms(err, what):
    """milliseconds from llama.cpp's timing line, e.g. 'common_perf_print: load time = 1234.5 ms'."""
    m = re.search(rf"(?<![a-z] ){what} time =\s*([0-9.]+) ms", err)
    return float(m.group(1)) if m else None


def thp_mode():
    try:
        s = open(THP).read()
        return s[s.index("[") + 1:s.index("]")]
    except (OSError, ValueError):
        return None


def set_thp(mode):
    with open(THP, "w") as f:
        f.write(mode)


def run_one(args, budget, config, tmp):
    if config == "sdq-never":
        saved = thp_mode()
        set_thp("never")
        try:
            return run_one(args, budget, "sdq-never-inner", tmp) | {"config": config}
        finally:
            set_thp(saved)
    bin_dir = args.before_bin if config == "sdq-before" else BIN
    stats, report = benchlib.fresh_files(tmp, "stats.json", "limit.json")
    cmd = [os.path.join(BIN, "sdq"), "limit", "--memory", f"{budget}G", "--report", report, "--",
           os.path.join(bin_dir, "llama-completion"), "-m", args.model, "-p", PROMPT, "-n", str(args.tokens), "--top-k", "1",
           "-no-cnv", "-t", str(args.threads), "-c", "4096", "-ub", "128", "--seed", "1",
           "--ram-budget", f"{budget}G", "--sdq-stats", stats]
    env = dict(os.environ)
    for k in ("SDQ_PREFETCH", "SDQ_POPULATE", "SDQ_DIRECT_IO", "SDQ_PRELOAD", "SDQ_POLICY", "SDQ_HOTSET_FILE", "SDQ_HUGEPAGES"):
        env.pop(k, None)
    env.update(CONFIG_ENV.get(config, {}))
    drop_page_cache()
    started = time.monotonic()
    # Random weights can decode to bytes that are not UTF-8: keep them, escaped.
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, errors="backslashreplace", stdin=subprocess.DEVNULL,
                       timeout=args.timeout)
    row = {"budget_gib": budget, "config": config, "exit_code": p.returncode, "text": p.stdout,
           "seconds": round(time.monotonic() - started, 1),
           "decode_tps": speed(p.stderr, "eval"), "prompt_tps": speed(p.stderr, "prompt eval"),
           "load_ms": ms(p.stderr, "load"), "prompt_ms": ms(p.stderr, "prompt eval")}
    if row["load_ms"] is not None and row["prompt_ms"] is not None:
        row["ttft_s"] = (row["load_ms"] + row["prompt_ms"]) / 1000
    try:
        row["limit"] = json.load(open(report))
    except (OSError, ValueError):
        row["limit"] = None
    if os.path.exists(stats):
        s = json.load(open(stats))
        for k in ("hits", "misses", "rereads", "prefetched", "prefetch_used", "prefetch_late", "prefetch_wasted",
                  "bytes_read", "hit_rate", "mib_read_per_token", "peak_rss_anon_bytes", "vm_swap_bytes",
                  "arena_pages", "arena_huge_bytes", "arena_resident_bytes", "arena_populate", "arena_slot_bytes",
                  "minor_faults", "major_faults"):
            row[k] = s.get(k)
    if p.returncode != 0:
        row["stderr_tail"] = p.stderr[-2000:]
    return row


def med(rows, k):
    v = [r[k] for r in rows if r.get(k) is not None]
    return statistics.median(v) if v else None


def summarize(rows, budgets, configs, reference):
    out = []
    for b in budgets:
        for c in configs:
            rs = [r for r in rows if r["budget_gib"] == b and r["config"] == c]
            if not rs:
                continue
            lim = [r["limit"] for r in rs if r.get("limit")]
            out.append({"budget_gib": b, "config": c, "runs": len(rs), "ok": sum(r["exit_code"] == 0 for r in rs),
                        "decode_tps": med(rs, "decode_tps"), "prompt_tps": med(rs, "prompt_tps"),
                        "decode_runs": [r.get("decode_tps") for r in rs], "seconds": med(rs, "seconds"),
                        "ttft_s": med(rs, "ttft_s"), "minor_faults": med(rs, "minor_faults"),
                        "arena_huge_gib": (med(rs, "arena_huge_bytes") or 0) / 2**30,
                        "arena_resident_gib": (med(rs, "arena_resident_bytes") or 0) / 2**30,
                        "arena_pages": sorted({r.get("arena_pages") for r in rs if r.get("arena_pages")}),
                        "hit_rate": med(rs, "hit_rate"), "misses": med(rs, "misses"),
                        "prefetched": med(rs, "prefetched"), "prefetch_used": med(rs, "prefetch_used"),
                        "prefetch_late": med(rs, "prefetch_late"), "prefetch_wasted": med(rs, "prefetch_wasted"),
                        "mib_read_per_token": med(rs, "mib_read_per_token"),
                        "peak_rss_anon_gib": (med(rs, "peak_rss_anon_bytes") or 0) / 2**30 or None,
                        "peak_cgroup_gib": statistics.median([l["peak_bytes"] for l in lim]) / 2**30 if lim else None,
                        "swap_bytes": max([l.get("swap_bytes") or 0 for l in lim], default=None),
                        "oom_kills": sum(l.get("oom_kills") or 0 for l in lim)})
    for s in out:
        ref = next((t for t in out if t["budget_gib"] == s["budget_gib"] and t["config"] == reference), None)
        if ref and s["config"] != reference:
            for k in ("decode_tps", "prompt_tps"):
                if s[k] and ref[k]:
                    s[k.replace("_tps", "_vs_before")] = s[k] / ref[k]
            if s["ttft_s"] and ref["ttft_s"]:
                s["ttft_vs_before"] = s["ttft_s"] / ref["ttft_s"]
    return out


def fmt(v, spec):
    return "—" if v is None else format(v, spec)


def markdown(summary, meta):
    lines = [f"Machine: {meta['machine']}. Model: `{meta['model']}`. Date: {meta['date']}.",
             f"Command: `{meta['command']}`; medians of {meta['runs']} runs, alternating configurations; "
             "each run cold (page cache dropped, empty arena) in an enforced limit equal to the budget; "
             f"×ref is the ratio to {meta['reference']} of the same budget.", "",
             "| budget | config | ok | decode tok/s | ×ref | prompt tok/s | ×ref | first token s (load + prompt) | ×ref | run s | hit % | misses | prefetched (used, late, wasted) | MiB read/token | minor faults | arena resident GiB | in huge pages GiB | peak anon RSS GiB | peak cgroup GiB | swap | OOM kills |",
             "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for s in summary:
        pf = "—" if not s["prefetched"] else f"{s['prefetched']:.0f} ({fmt(s['prefetch_used'], '.0f')}, {fmt(s['prefetch_late'], '.0f')}, {fmt(s['prefetch_wasted'], '.0f')})"
        lines.append(f"| {s['budget_gib']} GiB | {s['config']} | {s['ok']}/{s['runs']} | {fmt(s['decode_tps'], '.2f')} | "
                     f"{fmt(s.get('decode_vs_before'), '.2f')} | {fmt(s['prompt_tps'], '.2f')} | {fmt(s.get('prompt_vs_before'), '.2f')} | "
                     f"{fmt(s.get('ttft_s'), '.2f')} | {fmt(s.get('ttft_vs_before'), '.2f')} | {fmt(s['seconds'], '.1f')} | "
                     f"{fmt(s['hit_rate'] and 100 * s['hit_rate'], '.1f')} | {fmt(s['misses'], '.0f')} | {pf} | "
                     f"{fmt(s['mib_read_per_token'], '.1f')} | {fmt(s.get('minor_faults'), '.0f')} | {fmt(s.get('arena_resident_gib'), '.2f')} | {fmt(s.get('arena_huge_gib'), '.2f')} | "
                     f"{fmt(s['peak_rss_anon_gib'], '.2f')} | {fmt(s['peak_cgroup_gib'], '.2f')} | "
                     f"{fmt(s['swap_bytes'], 'd')} | {s['oom_kills']} |")
    return "\n".join(lines) + "\n"


def plot(summary, path, tokens=64):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("bench-decode: matplotlib not installed; no plot", file=sys.stderr)
        return
    budgets = sorted({s["budget_gib"] for s in summary})
    configs = [c for c in CONFIGS if any(s["config"] == c for s in summary)]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    w = 0.8 / len(configs)
    panels = [("decode_tps", f"decode tokens/s (cold start, {tokens} tokens)", "%.2f"),
              ("ttft_s", "first token s (load + prompt)", "%.1f")]
    for ax, (key, label, fmt_) in zip(axes, panels):
        for i, c in enumerate(configs):
            xs = [j + (i - (len(configs) - 1) / 2) * w for j in range(len(budgets))]
            ys = [next((s.get(key) or 0 for s in summary if s["budget_gib"] == b and s["config"] == c), 0) for b in budgets]
            bars = ax.bar(xs, ys, w, label=c)
            ax.bar_label(bars, fmt=fmt_, fontsize=7)
        ax.set_xticks(range(len(budgets)))
        ax.set_xticklabels([f"{b} GiB" for b in budgets])
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    fig.suptitle("35B-A3B geometry inside an enforced limit (medians)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=os.path.join(ROOT, "models", "35b-a3b.gguf"))
    ap.add_argument("--budgets", default="2,4,8")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--tokens", type=int, default=64, help="greedy tokens per run (default 64)")
    ap.add_argument("--configs", default="sdq,sdq-noprefetch,sdq-before")
    ap.add_argument("--before-bin", help="target/release of an earlier sdq build (config sdq-before)")
    ap.add_argument("--reference", default="sdq-before", help="the configuration ratios are to (default sdq-before)")
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "bench"))
    ap.add_argument("--name", default="decode")
    ap.add_argument("--replot", action="store_true", help="only redraw NAME.png from NAME.json (give its --tokens)")
    args = ap.parse_args()
    if args.replot:
        plot(json.load(open(os.path.join(args.out, f"{args.name}.json")))["summary"], os.path.join(args.out, f"{args.name}.png"), args.tokens)
        return
    budgets = [int(b) for b in args.budgets.split(",")]
    configs = args.configs.split(",")
    if "sdq-before" in configs and not args.before_bin:
        sys.exit("bench-decode: config sdq-before needs --before-bin DIR")
    if not os.path.exists(args.model):
        subprocess.run([os.path.join(BIN, "sdq"), "gen-model", "--preset", "35b-a3b", "-o", args.model], check=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for run in range(args.runs):
            for b in budgets:
                for c in configs:
                    r = run_one(args, b, c, tmp)
                    r["run"] = run
                    rows.append(r)
                    print(f"run {run} {b} GiB {c}: decode {r['decode_tps']} prompt {r['prompt_tps']} exit {r['exit_code']}"
                          f" hit {r.get('hit_rate')} prefetched {r.get('prefetched')} used {r.get('prefetch_used')}", file=sys.stderr)
    # Every run of one build must give the same text. Two builds may differ:
    # a kernel change (such as the tiled kernel, which stock uses for 8+ rows
    # of an expert) moves greedy choices on this random-weight model, whose
    # logits are nearly tied (stock itself changes text with --repack 0).
    build = lambda c: "before" if c == "sdq-before" else "this"
    reference = {}
    for r in rows:
        if r["exit_code"] == 0:
            reference.setdefault(build(r["config"]), r["text"])
    differ = [f"{r['budget_gib']} GiB {r['config']} run {r['run']}" for r in rows
              if r["exit_code"] == 0 and r["text"] != reference[build(r["config"])]]
    failed = [f"{r['budget_gib']} GiB {r['config']} run {r['run']}" for r in rows if r["exit_code"] != 0]
    summary = summarize(rows, budgets, configs, args.reference)
    meta = {"machine": f"{platform.node()} {os.cpu_count()} cores, {platform.machine()}", "model": args.model,
            "date": datetime.date.today().isoformat(), "runs": args.runs,
            "command": "scripts/bench-decode.py " + " ".join(sys.argv[1:]), "reference": args.reference,
            "outputs_differ": differ, "failed": failed}
    for r in rows:
        r.pop("text")
    os.makedirs(args.out, exist_ok=True)
    json.dump({"meta": meta, "summary": summary, "runs": rows}, open(os.path.join(args.out, f"{args.name}.json"), "w"), indent=1)
    md = markdown(summary, meta)
    open(os.path.join(args.out, f"{args.name}.md"), "w").write(md)
    plot(summary, os.path.join(args.out, f"{args.name}.png"), args.tokens)
    print(md)
    if differ or failed:
        sys.exit(f"bench-decode: output differs from the first run of the same build: {differ}; failed: {failed}")


if __name__ == "__main__":
    main()
