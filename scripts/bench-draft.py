#!/usr/bin/env python3
"""Drafting under a budget: decode speed and bytes read with and without it.

For each budget B (GiB) and each drafting mode, every run starts with the
page cache dropped and starts llama-server under `sdq limit --memory B` with
`--ram-budget B` (page cache counted, no swap), then asks for --requests
greedy completions (--top-k 1, --tokens each, a prompt of about 20 tokens,
no prompt cache). Modes:
  none       no drafting
  ngram      --spec-type ngram-simple with 3-token keys and drafts of up to 8
             (self-drafting from the text so far)
  draft-mtp  --spec-type draft-mtp (the model's NextN block; the model needs
             one: `sdq gen-model --preset 35b-a3b --nextn 1`)
  draft-model  -md DRAFT --spec-type draft-simple (--draft: a small model
             with the same vocabulary; its routed experts are paged beside
             the target's, e.g. `sdq gen-model --preset tiny --vocab 248320`)
The decode speed is the server's own (`timings.predicted_per_second`); the
drafts made and accepted are its timings' `draft_n` and `draft_n_accepted`.
Bytes read come from the stats file: all the run's expert reads (prompts,
drafts and verification batches), over the tokens the requests generated.
A generated model's random weights loop after a few dozen tokens, which
n-gram drafting predicts well and an untrained MTP head does not: these are
figures of the mechanics (what drafting costs and saves in reads), not of a
trained model's acceptance. Verification batches run several tokens at
once, whose sums ggml orders otherwise than one token's: at full depth the
text with drafting can part from the text without it, in stock as under a
budget (the tests check each mode against stock with the same flags, on
cut models). The report says whether each mode's answers were the same in
every run and budget, and whether they equal the undrafted ones.

Writes NAME.json and NAME.md into --out.

Usage: scripts/bench-draft.py [--model models/35b-a3b-mtp.gguf] [--budgets 8,4] [--runs 2]
                           [--modes none,ngram,draft-mtp] [--draft FILE] [--requests 2] [--tokens 64]
                           [--out docs/bench] [--name issue29-drafting]
"""
import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402 (scripts/benchlib.py)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.join(ROOT, "target", "release")
PROMPTS = ["Write a short history of the harbour and the river trade of the old city.",
           "Count the boats: one boat, two boats, three boats, four boats, five boats."]
MODES = {"none": [], "ngram": ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3", "--spec-ngram-simple-size-m", "8"],
         "draft-mtp": ["--spec-type", "draft-mtp"]}


def mode_flags(args, mode):
    if mode == "draft-model":
        return ["-md", args.draft, "--spec-type", "draft-simple"]
    return MODES[mode]


def run_one(args, budget, mode, tmp):
    stats, report = benchlib.fresh_files(tmp, "stats.json", "limit.json")
    benchlib.drop_page_cache("bench-draft", "runs would not start cold", fatal=True)

    def cmd(port):
        return ([os.path.join(BIN, "sdq"), "limit", "--memory", f"{budget}G", "--report", report, "--",
                 os.path.join(BIN, "llama-server"), "-m", args.model, "--port", str(port), "-t", str(args.threads), "-c", "4096",
                 "-np", "1", "--no-warmup", "--ram-budget", f"{budget}G", "--sdq-stats", stats] + mode_flags(args, mode))

    row = {"budget_gib": budget, "mode": mode, "exit_code": 0, "decode_tps": [], "texts": [], "drafted": 0, "accepted": 0, "generated": 0}

    def use(url):
        for i in range(args.requests):
            text, t = benchlib.complete(url, PROMPTS[i % len(PROMPTS)], args.tokens, args.timeout)
            row["decode_tps"].append(t["predicted_per_second"])
            row["texts"].append(text)
            row["generated"] += t["predicted_n"]
            row["drafted"] += t.get("draft_n", 0)
            row["accepted"] += t.get("draft_n_accepted", 0)

    benchlib.serve(row, cmd, os.path.join(tmp, f"{mode}.err"), args.timeout, use, stop_timeout=300)
    row.update(benchlib.limit_figures(report))
    row.update(benchlib.stats_figures(stats, ("bytes_read", "hit_rate", "arena_bytes", "expert_bytes_total", "peak_rss_anon_bytes", "vm_swap_bytes")))
    if row.get("bytes_read") is not None and row["generated"]:
        row["mib_read_per_generated_token"] = row["bytes_read"] / 2**20 / row["generated"]
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=os.path.join(ROOT, "models", "35b-a3b-mtp.gguf"))
    ap.add_argument("--label", default="", help="what the model is, for the report")
    ap.add_argument("--budgets", default="8,4")
    ap.add_argument("--modes", default="none,ngram,draft-mtp")
    ap.add_argument("--draft", help="the draft model of the draft-model mode")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--requests", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "bench"))
    ap.add_argument("--name", default="issue29-drafting")
    args = ap.parse_args()
    budgets = [int(b) for b in args.budgets.split(",")]
    modes = args.modes.split(",")
    for m in modes:
        if m not in MODES and m != "draft-model":
            sys.exit(f"bench-draft: unknown mode '{m}' (modes: {', '.join(MODES)}, draft-model)")
        if m == "draft-model" and not (args.draft and os.path.isfile(args.draft)):
            sys.exit("bench-draft: the draft-model mode needs --draft FILE, an existing model")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for run in range(args.runs):
            for budget in budgets:
                # Modes alternate within a run, so that drift on a shared
                # machine falls on all of them alike.
                for mode in modes:
                    r = run_one(args, budget, mode, tmp)
                    r["run"] = run
                    rows.append(r)
                    print(f"run {run} {budget} GiB {mode}: decode {r['decode_tps']} drafted {r['drafted']} accepted {r['accepted']} "
                          f"MiB/token {r.get('mib_read_per_generated_token')} exit {r['exit_code']}", file=sys.stderr)
    ok = [r for r in rows if r["exit_code"] == 0 and len(r["texts"]) == args.requests]
    # Within a mode every run must answer alike; across modes, see above.
    firsts = {m: next((r["texts"] for r in ok if r["mode"] == m), None) for m in modes}
    differ = [f"{r['mode']} {r['budget_gib']} GiB run {r['run']}" for r in ok if r["texts"] != firsts[r["mode"]]]
    same_as_none = {m: firsts[m] == firsts.get("none") for m in modes if firsts[m] is not None}
    failed = [f"{r['mode']} {r['budget_gib']} GiB run {r['run']}" for r in rows if r not in ok]
    med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
    summary = []
    for budget in budgets:
        base = None
        for mode in modes:
            rs = [r for r in ok if r["budget_gib"] == budget and r["mode"] == mode]
            tps = med([t for r in rs for t in r["decode_tps"]])
            row = {"budget_gib": budget, "mode": mode, "runs": len(rs), "decode_tps": tps,
                   "mib_read_per_generated_token": med([r["mib_read_per_generated_token"] for r in rs if r.get("mib_read_per_generated_token")]),
                   "drafted": med([r["drafted"] for r in rs]), "accepted": med([r["accepted"] for r in rs]),
                   "generated": med([r["generated"] for r in rs]), "hit_rate": med([r["hit_rate"] for r in rs if r.get("hit_rate") is not None]),
                   "arena_gib": med([r["arena_bytes"] / 2**30 for r in rs if r.get("arena_bytes")]),
                   "peak_cgroup_gib": max([(r.get("peak_cgroup_bytes") or 0) / 2**30 for r in rs], default=None),
                   "swap_bytes": max([r.get("swap_bytes") or 0 for r in rs], default=0), "oom_kills": sum(r.get("oom_kills") or 0 for r in rs)}
            if mode == "none":
                base = row
            row["speedup"] = tps / base["decode_tps"] if base and tps and base["decode_tps"] else None
            summary.append(row)
    meta = {"machine": f"{platform.node()} {os.cpu_count()} cores, {platform.machine()}", "model": args.model,
            "label": args.label, "date": datetime.date.today().isoformat(), "runs": args.runs, "requests": args.requests, "tokens": args.tokens,
            "command": "scripts/bench-draft.py " + " ".join(sys.argv[1:]), "answers_differ": differ, "failed": failed,
            "same_text_as_undrafted": same_as_none}
    for r in rows:
        r.pop("texts")
    os.makedirs(args.out, exist_ok=True)
    json.dump({"meta": meta, "summary": summary, "runs": rows}, open(os.path.join(args.out, f"{args.name}.json"), "w"), indent=1)
    fmt = lambda v, spec: "—" if v is None else format(v, spec)  # noqa: E731
    model = f"{args.label} (`{meta['model']}`)" if args.label else f"`{meta['model']}`"
    lines = [f"Machine: {meta['machine']}. Model: {model}. Date: {meta['date']}. Command: `{meta['command']}`.",
             f"Each cell: the median of {args.runs} cold runs of {args.requests} greedy requests of {args.tokens} tokens, "
             "inside `sdq limit --memory B` with `--ram-budget B`. Each mode answered alike in every run and budget: "
             + ("yes" if not differ else "NO: " + ", ".join(differ)) + ". Same text as without drafting: "
             + ", ".join(f"{m} {'yes' if v else 'no'}" for m, v in same_as_none.items() if m != "none") + "."
             + (" Failed: " + ", ".join(failed) if failed else ""),
             "",
             "| budget | drafting | decode tok/s | × none | drafted | accepted | MiB read / generated token | hit % | arena GiB | peak cgroup GiB | swap |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for s in summary:
        lines.append(f"| {s['budget_gib']} GiB | {s['mode']} | {fmt(s['decode_tps'], '.2f')} | {fmt(s['speedup'], '.2f')} | {fmt(s['drafted'], '.0f')} | "
                     f"{fmt(s['accepted'], '.0f')} | {fmt(s['mib_read_per_generated_token'], '.1f')} | "
                     f"{fmt(s['hit_rate'] * 100 if s['hit_rate'] is not None else None, '.1f')} | {fmt(s['arena_gib'], '.2f')} | "
                     f"{fmt(s['peak_cgroup_gib'], '.2f')} | {s['swap_bytes']} |")
    open(os.path.join(args.out, f"{args.name}.md"), "w").write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
