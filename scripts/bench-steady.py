#!/usr/bin/env python3
"""Steady-state decode: sdq in an enforced limit against stock with the file cached.

A server that has answered for a while decodes at the speed its arena's hit
rate allows; this measures that speed. Each run starts llama-server, sends
--warmup greedy requests (128 tokens each, their own prompts) and then
--measure requests (--tokens each, other prompts); the decode speed is the
server's own (`timings.predicted_per_second`), the median over the measured
requests. Configurations alternate run by run:
  sdq    --ram-budget B inside `sdq limit --memory B` (page cache counted, no swap)
  stock  no budget and no limit, the model read into the page cache first
The measured answers must be the same in every run of both.

Writes NAME.json and NAME.md into --out.

Usage: scripts/bench-steady.py [--budget 8] [--runs 2] [--threads 2] [--warmup 4] [--measure 4]
                            [--tokens 64] [--model models/35b-a3b.gguf] [--out docs/bench] [--name steady]
"""
import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402 (scripts/benchlib.py)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.join(ROOT, "target", "release")
SUBJECTS = ["the harbour", "a winter market", "the river trade", "the old bridge", "a lighthouse keeper", "the city walls",
            "the salt roads", "a fishing village", "the first railway", "the great fire", "the cathedral", "the printing press"]


def run_one(args, config, tmp):
    stats, report = benchlib.fresh_files(tmp, "stats.json", "limit.json")

    def cmd(port):
        c = [os.path.join(BIN, "llama-server"), "-m", args.model, "--port", str(port), "-t", str(args.threads), "-c", "4096", "-np", "1"]
        if config == "sdq":
            return ([os.path.join(BIN, "sdq"), "limit", "--memory", f"{args.budget}G", "--report", report, "--"] + c
                    + ["--ram-budget", f"{args.budget}G", "--sdq-stats", stats])
        return c

    if config != "sdq":
        subprocess.run(["cat", args.model], stdout=subprocess.DEVNULL, check=True)
    row = {"config": config, "exit_code": 0, "decode_tps": [], "texts": []}

    def use(url):
        for i in range(args.warmup):
            benchlib.complete(url, f"Tell the story of {SUBJECTS[i % len(SUBJECTS)]} in the old city.", 128, args.timeout)
        for i in range(args.measure):
            text, t = benchlib.complete(url, f"Write a short history of {SUBJECTS[-1 - i % len(SUBJECTS)]}.", args.tokens, args.timeout)
            row["decode_tps"].append(t["predicted_per_second"])
            row["texts"].append(text)

    benchlib.serve(row, cmd, os.path.join(tmp, f"{config}.err"), args.timeout, use)
    row.update(benchlib.limit_figures(report))
    row.update(benchlib.stats_figures(stats, ("hit_rate", "mib_read_per_token", "peak_rss_anon_bytes", "arena_pages", "arena_huge_bytes",
                                              "arena_slot_bytes", "arena_populate", "minor_faults", "major_faults")))
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=os.path.join(ROOT, "models", "35b-a3b.gguf"))
    ap.add_argument("--budget", type=int, default=8, help="GiB (default 8)")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--measure", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "bench"))
    ap.add_argument("--name", default="steady")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for run in range(args.runs):
            for config in ("sdq", "stock"):
                r = run_one(args, config, tmp)
                r["run"] = run
                rows.append(r)
                print(f"run {run} {config}: decode {r['decode_tps']} exit {r['exit_code']} hit {r.get('hit_rate')}", file=sys.stderr)
    ok = [r for r in rows if r["exit_code"] == 0 and len(r["texts"]) == args.measure]
    differ = [f"{r['config']} run {r['run']}" for r in ok if r["texts"] != ok[0]["texts"]]
    failed = [f"{r['config']} run {r['run']}" for r in rows if r not in ok]
    summary = []
    for config in ("sdq", "stock"):
        rs = [r for r in ok if r["config"] == config]
        tps = [t for r in rs for t in r["decode_tps"]]
        summary.append({"config": config, "runs": len(rs), "decode_tps": statistics.median(tps) if tps else None, "decode_all": tps,
                        "hit_rate": statistics.median([r["hit_rate"] for r in rs]) if config == "sdq" and rs else None,
                        "mib_read_per_token": statistics.median([r["mib_read_per_token"] for r in rs]) if config == "sdq" and rs else None,
                        "arena_huge_gib": statistics.median([(r.get("arena_huge_bytes") or 0) / 2**30 for r in rs]) if config == "sdq" and rs else None,
                        "minor_faults": statistics.median([r.get("minor_faults") or 0 for r in rs]) if config == "sdq" and rs else None,
                        "peak_rss_anon_gib": statistics.median([r["peak_rss_anon_bytes"] / 2**30 for r in rs]) if config == "sdq" and rs else None,
                        "swap_bytes": max([r.get("swap_bytes") or 0 for r in rs], default=0),
                        "oom_kills": sum(r.get("oom_kills") or 0 for r in rs)})
    sdq, stock = summary
    ratio = sdq["decode_tps"] / stock["decode_tps"] if sdq["decode_tps"] and stock["decode_tps"] else None
    meta = {"machine": f"{platform.node()} {os.cpu_count()} cores, {platform.machine()}", "model": args.model,
            "date": datetime.date.today().isoformat(), "runs": args.runs, "budget_gib": args.budget,
            "command": "scripts/bench-steady.py " + " ".join(sys.argv[1:]), "sdq_over_stock": ratio,
            "answers_differ": differ, "failed": failed}
    for r in rows:
        r.pop("texts")
    os.makedirs(args.out, exist_ok=True)
    json.dump({"meta": meta, "summary": summary, "runs": rows}, open(os.path.join(args.out, f"{args.name}.json"), "w"), indent=1)
    fmt = lambda v, spec: "—" if v is None else format(v, spec)  # noqa: E731
    lines = [f"Machine: {meta['machine']}. Model: `{meta['model']}`. Date: {meta['date']}.",
             f"Command: `{meta['command']}`; {args.runs} runs per configuration, alternating; each run a fresh server, "
             f"{args.warmup} warm-up requests of 128 tokens, then {args.measure} measured requests of {args.tokens} tokens "
             "(median of the server's decode speed over them). Answers identical: " + ("yes" if not differ else f"no ({differ})") + ".", "",
             "| config | ok | decode tok/s | each request | hit % | MiB read/token | minor faults | arena in huge pages GiB | peak anon RSS GiB | swap | OOM kills |",
             "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for s in summary:
        label = f"sdq, {args.budget} GiB enforced" if s["config"] == "sdq" else "stock, file cached, no limit"
        lines.append(f"| {label} | {s['runs']}/{args.runs} | {fmt(s['decode_tps'], '.2f')} | {', '.join(fmt(v, '.1f') for v in s['decode_all'])} | "
                     f"{fmt(s['hit_rate'] and 100 * s['hit_rate'], '.1f')} | {fmt(s['mib_read_per_token'], '.1f')} | {fmt(s['minor_faults'], '.0f')} | {fmt(s['arena_huge_gib'], '.2f')} | "
                     f"{fmt(s['peak_rss_anon_gib'], '.2f')} | {s['swap_bytes']} | {s['oom_kills']} |")
    lines += ["", f"sdq / stock steady-state decode: {fmt(ratio, '.2f')}."]
    benchlib.write_table(args.out, args.name, "\n".join(lines) + "\n", "bench-steady", differ, failed)


if __name__ == "__main__":
    main()
