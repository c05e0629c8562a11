#!/usr/bin/env python3
"""The budget curve: sdq against stock llama.cpp inside enforced memory limits.

For each budget, each configuration runs llama-bench under `sdq limit` (a memory
cgroup whose limit is the budget, page cache counted, no swap):
  sdq           the same binary with --ram-budget = the limit (SDQ_RAM_BUDGET)
  stock         no budget: the model mmapped, Q4_K experts repacked (default)
  stock-norepack no budget, --repack 0
  sdq-noprefetch sdq with SDQ_PREFETCH=0 (no reading ahead)
  sdq-before    an earlier sdq build (--before-bin), for before/after ratios
  sdq-norepack  sdq with --repack 0, against stock-norepack (the same kernels
                for the weights that stay in memory)
Each is run --runs times; the medians and sdq/stock ratios (from the same run
of this script) go to a JSON file, a Markdown table and, if matplotlib is
available, a PNG plot. A configuration whose first run at a budget is
OOM-killed or passes --timeout is not repeated there: it would only fail again
(the table says so).

Usage: scripts/bench-memory.py [--model M] [--budgets 2,4,8,16] [--runs 3]
                            [--prompt 64] [--gen 32] [--threads 2]
                            [--timeout 600] [--out DIR] [--name memory]
                            [--reps 1] [--no-warmup]

With --reps N, llama-bench repeats each test N times in one process; the
table gives the mean, and the JSON also the last repetition (`*_last`), by
which time an arena that holds every expert is warm.
"""
import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import signal
import tempfile
import time
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402 (scripts/benchlib.py)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.join(ROOT, "target", "release")
CONFIGS = ["sdq", "sdq-noprefetch", "sdq-before", "stock", "stock-norepack", "sdq-norepack"]
SDQ_CONFIGS = ("sdq", "sdq-noprefetch", "sdq-before", "sdq-norepack")


def drop_page_cache():
    return benchlib.drop_page_cache("bench-memory", "runs start warm", fatal=False)


def run_one(args, budget_gib, config, tmp, threads):
    limit = f"{budget_gib}G"
    report, stats = benchlib.fresh_files(tmp, "limit.json", "stats.json")
    bin_dir = args.before_bin if config == "sdq-before" else BIN
    cmd = [os.path.join(bin_dir, "llama-bench"), "-m", args.model, "-p", str(args.prompt), "-n", str(args.gen),
           "-r", str(args.reps), "-t", str(threads), "-o", "jsonl"]
    if args.no_warmup:
        cmd.append("--no-warmup")
    env = dict(os.environ)
    env.pop("SDQ_RAM_BUDGET", None)
    env.pop("SDQ_PREFETCH", None)
    if config in SDQ_CONFIGS:
        env["SDQ_RAM_BUDGET"] = limit
        env["SDQ_STATS_FILE"] = stats
        if config == "sdq-noprefetch":
            env["SDQ_PREFETCH"] = "0"
        if config == "sdq-norepack":
            cmd += ["--repack", "0"]
    elif config == "stock-norepack":
        cmd += ["--repack", "0"]
    full = [os.path.join(BIN, "sdq"), "limit", "--memory", limit, "--report", report, "--"] + cmd
    row_cold = drop_page_cache()
    t0 = time.monotonic()
    p = subprocess.Popen(full, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         stdin=subprocess.DEVNULL)
    timed_out = False
    try:
        out, err = p.communicate(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        # sdq limit forwards SIGTERM to the command and removes its cgroup.
        timed_out = True
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate()
    row = {"budget_gib": budget_gib, "config": config, "exit_code": p.returncode,
           "timed_out": timed_out, "seconds": round(time.monotonic() - t0, 1), "cold": row_cold}
    try:
        row["limit"] = json.load(open(report))
    except (OSError, ValueError):
        row["limit"] = None
    # One JSON object per finished test (prefill, then decode): a run stopped
    # at the timeout still reports the tests it finished.
    bench = []
    for line in out.splitlines():
        try:
            bench.append(json.loads(line))
        except ValueError:
            pass
    row["prefill_tps"] = next((t["avg_ts"] for t in bench if t.get("n_prompt", 0) > 0 and t.get("n_gen") == 0), None)
    row["decode_tps"] = next((t["avg_ts"] for t in bench if t.get("n_gen", 0) > 0 and t.get("n_prompt") == 0), None)
    row["prefill_tps_last"] = next((t["samples_ts"][-1] for t in bench if t.get("n_prompt", 0) > 0 and t.get("n_gen") == 0 and t.get("samples_ts")), None)
    row["decode_tps_last"] = next((t["samples_ts"][-1] for t in bench if t.get("n_gen", 0) > 0 and t.get("n_prompt") == 0 and t.get("samples_ts")), None)
    if not bench:
        row["stderr_tail"] = err[-2000:]
    if config in SDQ_CONFIGS and os.path.exists(stats):
        s = json.load(open(stats))
        for k in ("prefetched", "prefetch_used", "prefetch_late", "prefetch_wasted", "preloaded", "misses", "hits", "bytes_read",
                  "rereads", "miss_batches", "miss_batch_bytes", "miss_batch_mib_per_s"):
            row[k] = s.get(k)
        row["hit_rate"] = s.get("hit_rate")
        row["mib_read_per_token"] = s.get("mib_read_per_token")
        row["peak_rss_anon_bytes"] = s.get("peak_rss_anon_bytes")
        row["vm_swap_bytes"] = s.get("vm_swap_bytes")
    lim = row["limit"] or {}
    row["completed"] = p.returncode == 0 and not timed_out
    row["oom_killed"] = (lim.get("oom_kills") or 0) > 0
    return row


def median(rows, key):
    vals = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def summarize(rows, budgets):
    out = []
    for b in budgets:
        for c in dict.fromkeys(r["config"] for r in rows):
            rs = [r for r in rows if r["budget_gib"] == b and r["config"] == c]
            if not rs:
                continue
            lim = [r["limit"] for r in rs if r["limit"]]
            out.append({
                "budget_gib": b, "config": c, "runs": len(rs),
                "completed": sum(r["completed"] for r in rs),
                "oom_killed": sum(r["oom_killed"] for r in rs),
                "timed_out": sum(r.get("timed_out", False) for r in rs),
                "timeout_s": max((r["seconds"] for r in rs if r.get("timed_out")), default=None),
                "decode_tps": median(rs, "decode_tps"),
                "prefill_tps": median(rs, "prefill_tps"),
                "decode_tps_last": median(rs, "decode_tps_last"),
                "prefill_tps_last": median(rs, "prefill_tps_last"),
                "prefetched": median(rs, "prefetched"),
                "prefetch_used": median(rs, "prefetch_used"),
                "hit_rate": median(rs, "hit_rate"),
                "miss_batch_mib_per_s": median(rs, "miss_batch_mib_per_s"),
                "mib_read_per_token": median(rs, "mib_read_per_token"),
                "peak_rss_anon_gib": (median(rs, "peak_rss_anon_bytes") or 0) / 2**30 or None,
                "peak_cgroup_gib": statistics.median([l["peak_bytes"] for l in lim]) / 2**30 if lim else None,
                "swap_bytes": max([l.get("swap_bytes") or 0 for l in lim], default=None),
                "major_faults": statistics.median([l.get("major_faults") or 0 for l in lim]) if lim else None,
            })
    # sdq/stock ratios against each stock configuration, from this same run
    for s in out:
        name, _, suffix = s["config"].partition("-t")
        bases = {"sdq": ("stock", "stock-norepack", "sdq-before", "sdq-noprefetch"), "sdq-norepack": ("stock-norepack",)}
        for base in bases.get(name, ()):
            label = f"{base}-t{suffix}" if suffix else base
            ref = next((t for t in out if t["budget_gib"] == s["budget_gib"] and t["config"] == label), None)
            for k in ("decode_tps", "prefill_tps", "decode_tps_last", "prefill_tps_last"):
                if ref and s[k] and ref[k]:
                    s[f"{k.replace('_tps', '')}_ratio_vs_{base.replace('-', '_')}"] = s[k] / ref[k]
    return out


def fmt(v, spec):
    return "—" if v is None else format(v, spec)


def markdown(summary, meta):
    lines = [f"Machine: {meta['machine']}. Model: `{meta['model']}`. Date: {meta['date']}.",
             f"Command: `{meta['command']}`; medians of {meta['runs']} runs; limits enforced by `sdq limit` ({meta['mode']}).",
             "done/OOM/timeout counts runs; a configuration OOM-killed or timed out on its first run at a budget is not repeated there.", "",
             "| budget | config | done/OOM/timeout | decode tok/s | prefill tok/s | sdq/stock decode | sdq/stock-norepack decode | hit % | MiB read/token | peak anon RSS GiB | peak cgroup GiB | swap | major faults |",
             "| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for s in summary:
        lines.append(
            f"| {s['budget_gib']} GiB | {s['config']} | {s['completed']}/{s['oom_killed']}/{s.get('timed_out', 0)} | {fmt(s['decode_tps'], '.2f')} | "
            f"{fmt(s['prefill_tps'], '.2f')} | {fmt(s.get('decode_ratio_vs_stock'), '.2f')} | "
            f"{fmt(s.get('decode_ratio_vs_stock_norepack'), '.2f')} | "
            f"{fmt(s['hit_rate'] and 100 * s['hit_rate'], '.1f')} | {fmt(s['mib_read_per_token'], '.1f')} | "
            f"{fmt(s['peak_rss_anon_gib'], '.2f')} | {fmt(s['peak_cgroup_gib'], '.2f')} | {fmt(s['swap_bytes'], 'd')} | {fmt(s['major_faults'], '.0f')} |")
    before = [s for s in summary if s.get("decode_ratio_vs_sdq_before")]
    if before:
        lines.append("")
        lines.append("sdq against the earlier build (`sdq-before`, same run): " + "; ".join(
            f"{s['budget_gib']} GiB decode {s['decode_ratio_vs_sdq_before']:.2f}×, prefill {fmt(s.get('prefill_ratio_vs_sdq_before'), '.2f')}×"
            for s in before) + ".")
    nopf = [s for s in summary if s.get("decode_ratio_vs_sdq_noprefetch")]
    if nopf:
        lines.append("")
        lines.append("sdq against sdq with SDQ_PREFETCH=0 (same run): " + "; ".join(
            f"{s['budget_gib']} GiB decode {s['decode_ratio_vs_sdq_noprefetch']:.2f}×, prefill {fmt(s.get('prefill_ratio_vs_sdq_noprefetch'), '.2f')}×"
            f" ({fmt(s.get('prefetch_used'), '.0f')} of {fmt(s.get('prefetched'), '.0f')} prefetched experts used)"
            for s in nopf) + ".")
    norepack = [s for s in summary if s["config"] == "sdq-norepack" and s.get("decode_ratio_vs_stock_norepack")]
    if norepack:
        lines.append("")
        lines.append("sdq --repack 0 against stock --repack 0 (same run): " + "; ".join(
            f"{s['budget_gib']} GiB decode {s['decode_ratio_vs_stock_norepack']:.2f}×, prefill {fmt(s.get('prefill_ratio_vs_stock_norepack'), '.2f')}×"
            f" (last repetition: decode {fmt(s.get('decode_last_ratio_vs_stock_norepack'), '.2f')}×, prefill {fmt(s.get('prefill_last_ratio_vs_stock_norepack'), '.2f')}×)"
            for s in norepack) + ".")
    if any(s.get("decode_tps_last") for s in summary) and meta.get("reps", 1) > 1:
        lines.append("")
        lines.append("Last repetition of each test (warm), medians: " + "; ".join(
            f"{s['budget_gib']} GiB {s['config']} decode {fmt(s.get('decode_tps_last'), '.2f')}, prefill {fmt(s.get('prefill_tps_last'), '.2f')}"
            for s in summary if s.get("decode_tps_last") or s.get("prefill_tps_last")) + ".")
    return "\n".join(lines) + "\n"


def plot(summary, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("bench-memory: matplotlib not installed (pip install matplotlib); no plot", file=sys.stderr)
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    for c, style, color in zip(CONFIGS, ["o-", "P-", "d-.", "s--", "^:", "v-"], ["tab:blue", "tab:purple", "tab:green", "tab:orange", "tab:red", "tab:cyan"]):
        pts = [(s["budget_gib"], s["decode_tps"]) for s in summary if s["config"] == c and s["decode_tps"]]
        if pts:
            ax.plot(*zip(*pts), style, color=color, label=f"{c} decode tok/s")
        oom = [s["budget_gib"] for s in summary if s["config"] == c and s["oom_killed"] and not s["decode_tps"]]
        if oom:
            ax.plot(oom, [0] * len(oom), "x", color=color, markersize=10, mew=2, label=f"{c}: OOM-killed")
        late = [s for s in summary if s["config"] == c and s.get("timed_out") and not s["decode_tps"] and not s["oom_killed"]]
        if late:
            # nudged apart so that two configurations at one budget both show
            ax.plot([s["budget_gib"] * (1.06 if c == "stock-norepack" else 1) for s in late], [0] * len(late), "v", color=color, markersize=9, fillstyle="none",
                    mew=2, label=f"{c}: not done in {max(s['timeout_s'] for s in late):.0f} s")
    ax.set_xlabel("RAM budget = enforced limit (GiB)")
    ax.set_ylabel("decode tokens/s")
    ax.set_xscale("log", base=2)
    budgets = sorted({s["budget_gib"] for s in summary})
    ax.set_xticks(budgets)
    ax.set_xticklabels([str(b) for b in budgets])
    ax.set_ylim(bottom=-0.3)
    ax2 = ax.twinx()
    pts = [(s["budget_gib"], 100 * s["hit_rate"]) for s in summary if s["config"] == "sdq" and s["hit_rate"] is not None]
    if pts:
        ax2.plot(*zip(*pts), ".-.", color="gray", alpha=0.7, label="sdq hit %")
    ax2.set_ylabel("sdq hit %")
    ax2.set_ylim(0, 100)
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, loc="upper left", fontsize=8)
    ax.set_title("35B-A3B geometry: decode speed against the RAM budget")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=os.path.join(ROOT, "models", "35b-a3b.gguf"))
    ap.add_argument("--budgets", default="2,4,8,16")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--threads", default="2", help="thread counts, e.g. 1,2 (with several, configs are named CONFIG-tN)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per run before it is stopped")
    ap.add_argument("--configs", default="sdq,stock,stock-norepack",
                    help="any of " + ",".join(CONFIGS) + " (sdq-before needs --before-bin)")
    ap.add_argument("--before-bin", help="target/release of an earlier sdq build, run as config sdq-before")
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "bench"))
    ap.add_argument("--name", default="memory", help="base name of the JSON, Markdown and PNG files")
    ap.add_argument("--reps", type=int, default=1, help="llama-bench repetitions per test (-r)")
    ap.add_argument("--no-warmup", action="store_true", help="no llama-bench warmup run: tests start with a cold arena")
    ap.add_argument("--from-json", help="re-render the table and plot from an earlier memory.json")
    args = ap.parse_args()
    if args.from_json:
        data = json.load(open(args.from_json))
        budgets = sorted({r["budget_gib"] for r in data["runs"]})
        summary = summarize(data["runs"], budgets)
        data["summary"] = summary
        os.makedirs(args.out, exist_ok=True)
        json.dump(data, open(os.path.join(args.out, f"{args.name}.json"), "w"), indent=1)
        md = markdown(summary, data["meta"])
        open(os.path.join(args.out, f"{args.name}.md"), "w").write(md)
        plot(summary, os.path.join(args.out, f"{args.name}.png"))
        print(md)
        return
    budgets = [int(b) for b in args.budgets.split(",")]
    configs = args.configs.split(",")
    threads = [int(t) for t in args.threads.split(",")]
    if not os.path.exists(args.model):
        print(f"bench-memory: generating {args.model} (about 21 GB, a few minutes)", file=sys.stderr)
        subprocess.run([os.path.join(BIN, "sdq"), "gen-model", "--preset", "35b-a3b", "-o", args.model], check=True)
    os.makedirs(args.out, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for run in range(args.runs):
            for b in budgets:
                for c, t in [(c, t) for c in configs for t in threads]:
                    label = c if len(threads) == 1 else f"{c}-t{t}"
                    first = next((r for r in rows if r["budget_gib"] == b and r["config"] == label), None)
                    if first and (first["oom_killed"] or first.get("timed_out")):
                        continue
                    r = run_one(args, b, c, tmp, t)
                    r["config"], r["threads"], r["run"] = label, t, run
                    rows.append(r)
                    print(f"run {run} {b} GiB {label}: decode {r.get('decode_tps')} prefill {r.get('prefill_tps')} "
                          f"exit {r['exit_code']} oom {r['oom_killed']} timeout {r['timed_out']} ({r['seconds']} s)", file=sys.stderr)
    summary = summarize(rows, budgets)
    mode = next((r["limit"]["mode"] for r in rows if r["limit"]), "?")
    meta = {
        "machine": f"{platform.node()} {os.cpu_count()} cores, {platform.machine()}",
        "model": args.model, "date": datetime.date.today().isoformat(), "runs": args.runs, "mode": mode,
        "command": "scripts/bench-memory.py " + " ".join(sys.argv[1:]), "reps": args.reps,
    }
    json.dump({"meta": meta, "summary": summary, "runs": rows}, open(os.path.join(args.out, f"{args.name}.json"), "w"), indent=1)
    md = markdown(summary, meta)
    open(os.path.join(args.out, f"{args.name}.md"), "w").write(md)
    plot(summary, os.path.join(args.out, f"{args.name}.png"))
    print(md)


if __name__ == "__main__":
    main()
