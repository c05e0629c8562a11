#!/usr/bin/env python3
"""Time to first token with and without a warm start (--sdq-hotset).

A first run writes a hot set: llama-completion on the model with one prompt
(--hot-prompt, 64 tokens) and --sdq-hotset. Then each measured run is a cold
start (page cache dropped) inside `sdq limit --memory B` with --ram-budget B,
generating one token from another prompt (--prompt): its wall time is the
time to first token (load, prompt, the first token, exit). Configurations
alternate run by run:
  cold  no hot set
  warm  --sdq-hotset with a fresh copy of the saved hot set (a run rewrites
        the file it was given at exit)
The first token must be the same in every run. llama.cpp's own load and
prompt times, and the stats file's figures (warm-start experts, misses,
bytes read), are kept per run.

With --server-idle S, each measured run is llama-server instead: started the
same way, asked for one token S seconds after it reports ready (a server
restarted before its first request), and the time to first token is that
request's, from sending it to the answer.

Writes NAME.json, NAME.md and (with matplotlib) NAME.png into --out.

Usage: scripts/bench-warm.py [--budget 8] [--runs 3] [--threads 2] [--server-idle S]
                          [--model models/35b-a3b.gguf] [--out docs/bench] [--name warm]
"""
import argparse
import datetime
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402 (scripts/benchlib.py)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.join(ROOT, "target", "release")
PROMPT = ("You are a careful assistant. Answer in plain words and keep to the facts you are given. "
          "The history of the city began with a small harbour where fishing boats came in at dawn, and the "
          "market that grew around it drew traders from the villages along the river. Tell the story of how "
          "the harbour became a port.")
HOT_PROMPT = "Write a letter to a friend about a long walk along the river"


def drop_page_cache():
    return benchlib.drop_page_cache("bench-warm", "runs would not start cold", fatal=True)


def ms(err, what):
    """milliseconds from llama.cpp's timing line, e.g. 'common_perf_print: load time = 1234.5 ms'."""
    m = re.search(rf"(?<![a-z] ){what} time =\s*([0-9.]+) ms", err)
    return float(m.group(1)) if m else None


def completion(args, budget, prompt, n, stats, hotset=None, report=None):
    cmd = [os.path.join(BIN, "llama-completion"), "-m", args.model, "-p", prompt, "-n", str(n), "--top-k", "1",
           "-no-cnv", "-t", str(args.threads), "-c", "4096", "-ub", "128", "--seed", "1",
           "--ram-budget", f"{budget}G", "--sdq-stats", stats]
    if hotset:
        cmd += ["--sdq-hotset", hotset]
    if report:
        cmd = [os.path.join(BIN, "sdq"), "limit", "--memory", f"{budget}G", "--report", report, "--"] + cmd
    return subprocess.run(cmd, env=benchlib.without_sdq_env(), capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=args.timeout)


def server(args, budget, stats, hotset, report):
    """llama-server in the limit: ready, idle, one request. Returns (exit code, request seconds, text, stderr)."""
    def cmd(port):
        c = [os.path.join(BIN, "sdq"), "limit", "--memory", f"{budget}G", "--report", report, "--",
             os.path.join(BIN, "llama-server"), "-m", args.model, "--port", str(port), "-t", str(args.threads),
             "-c", "4096", "-ub", "128", "-np", "1", "--ram-budget", f"{budget}G", "--sdq-stats", stats]
        return c + (["--sdq-hotset", hotset] if hotset else [])

    row = {"text": None, "seconds": None}

    def use(url):
        time.sleep(args.server_idle)
        body = {"prompt": args.prompt, "n_predict": 1, "temperature": 0, "cache_prompt": False}
        started = time.monotonic()
        row["text"] = benchlib.post_json(url + "/completion", body, args.timeout)["content"]
        row["seconds"] = round(time.monotonic() - started, 2)

    err = os.path.join(os.path.dirname(stats), "server.err")
    code = benchlib.serve(row, cmd, err, args.timeout, use)
    if row.get("error"):
        row["text"] = f"request failed: {row['error']}"
    seconds = row["seconds"]
    return (0 if seconds is not None else code or 1), seconds, row["text"], open(err).read()


def run_one(args, config, saved, tmp):
    stats, report = benchlib.fresh_files(tmp, "stats.json", "limit.json")
    hotset = None
    if config == "warm":
        hotset = os.path.join(tmp, "hot.txt")
        shutil.copyfile(saved, hotset)
    drop_page_cache()
    if args.server_idle is not None:
        code, seconds, text, err = server(args, args.budget, stats, hotset, report)
        row = {"config": config, "exit_code": code, "ttft_s": seconds, "text": text, "load_ms": None, "prompt_ms": None}
        if code != 0:
            row["stderr_tail"] = err[-2000:]
    else:
        started = time.monotonic()
        p = completion(args, args.budget, args.prompt, 1, stats, hotset, report)
        row = {"config": config, "exit_code": p.returncode, "ttft_s": round(time.monotonic() - started, 2), "text": p.stdout,
               "load_ms": ms(p.stderr, "load"), "prompt_ms": ms(p.stderr, "prompt eval")}
        if p.returncode != 0:
            row["stderr_tail"] = p.stderr[-2000:]
    row.update(benchlib.limit_figures(report))
    row.update(benchlib.stats_figures(stats, ("warm_start_experts", "hits", "misses", "preloaded", "bytes_read", "peak_rss_anon_bytes",
                                              "vm_swap_bytes", "arena_bytes")))
    return row


def med(rows, k):
    v = [r[k] for r in rows if r.get(k) is not None]
    return statistics.median(v) if v else None


def fmt(v, spec):
    return "—" if v is None else format(v, spec)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=os.path.join(ROOT, "models", "35b-a3b.gguf"))
    ap.add_argument("--budget", type=int, default=8, help="GiB (default 8)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--prompt", default=PROMPT, help="the measured runs' prompt (default: a 64-token chat-like one)")
    ap.add_argument("--hot-prompt", default=HOT_PROMPT)
    ap.add_argument("--server-idle", type=float, help="measure llama-server's first request, sent this many seconds after it is ready")
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "bench"))
    ap.add_argument("--name", default="warm")
    args = ap.parse_args()
    if not os.path.exists(args.model):
        subprocess.run([os.path.join(BIN, "sdq"), "gen-model", "--preset", "35b-a3b", "-o", args.model], check=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        saved = os.path.join(tmp, "saved-hot.txt")
        drop_page_cache()
        p = completion(args, args.budget, args.hot_prompt, 64, os.path.join(tmp, "first.json"), saved)
        if p.returncode != 0 or not os.path.exists(saved):
            sys.exit(f"bench-warm: the first run wrote no hot set:\n{p.stderr[-2000:]}")
        held = sum(1 for line in open(saved) if line.rstrip().endswith(",1"))
        print(f"bench-warm: hot set of {held} experts from a 64-token run of another prompt", file=sys.stderr)
        for run in range(args.runs):
            for c in ("cold", "warm"):
                r = run_one(args, c, saved, tmp)
                r["run"] = run
                rows.append(r)
                print(f"run {run} {c}: TTFT {r['ttft_s']} s (load {r['load_ms']} ms, prompt {r['prompt_ms']} ms) exit {r['exit_code']}"
                      f" warm {r.get('warm_start_experts')} misses {r.get('misses')}", file=sys.stderr)
    ok = [r for r in rows if r["exit_code"] == 0]
    differ = [f"{r['config']} run {r['run']}" for r in ok if r["text"] != ok[0]["text"]]
    failed = [f"{r['config']} run {r['run']}" for r in rows if r["exit_code"] != 0]
    summary = []
    for c in ("cold", "warm"):
        rs = [r for r in rows if r["config"] == c]
        summary.append({"config": c, "runs": len(rs), "ok": sum(r["exit_code"] == 0 for r in rs),
                        "ttft_s": med(rs, "ttft_s"), "ttft_runs": [r["ttft_s"] for r in rs],
                        "load_ms": med(rs, "load_ms"), "prompt_ms": med(rs, "prompt_ms"),
                        "warm_start_experts": med(rs, "warm_start_experts"), "misses": med(rs, "misses"), "hits": med(rs, "hits"),
                        "bytes_read": med(rs, "bytes_read"), "peak_rss_anon_bytes": med(rs, "peak_rss_anon_bytes"),
                        "peak_cgroup_bytes": med(rs, "peak_cgroup_bytes"), "swap_bytes": max([r.get("swap_bytes") or 0 for r in rs]),
                        "oom_kills": sum(r.get("oom_kills") or 0 for r in rs)})
    cold, warm = summary
    ratio = warm["ttft_s"] / cold["ttft_s"] if warm["ttft_s"] and cold["ttft_s"] else None
    meta = {"machine": f"{platform.node()} {os.cpu_count()} cores, {platform.machine()}", "model": args.model,
            "date": datetime.date.today().isoformat(), "runs": args.runs, "budget_gib": args.budget, "hot_set_experts": held,
            "command": "scripts/bench-warm.py " + " ".join(sys.argv[1:]), "warm_over_cold": ratio,
            "outputs_differ": differ, "failed": failed}
    for r in rows:
        r.pop("text")
    os.makedirs(args.out, exist_ok=True)
    json.dump({"meta": meta, "summary": summary, "runs": rows}, open(os.path.join(args.out, f"{args.name}.json"), "w"), indent=1)
    what = (f"llama-server's first request (one token), sent {args.server_idle} s after the server is ready" if args.server_idle is not None
            else "llama-completion from start to one token")
    lines = [f"Machine: {meta['machine']}. Model: `{meta['model']}`. Date: {meta['date']}.",
             f"Command: `{meta['command']}`; medians of {args.runs} runs, alternating; each run cold (page cache dropped) "
             f"in an enforced {args.budget} GiB limit; time to first token: {what}; the hot set ({held} experts) "
             "comes from a 64-token run of another prompt.", "",
             "| config | ok | time to first token s | runs | load ms | prompt ms | warm-start experts | misses | GiB read | peak anon RSS GiB | peak cgroup GiB | swap | OOM kills |",
             "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for s in summary:
        lines.append(f"| {s['config']} | {s['ok']}/{s['runs']} | {fmt(s['ttft_s'], '.2f')} | {', '.join(fmt(v, '.1f') for v in s['ttft_runs'])} | "
                     f"{fmt(s['load_ms'], '.0f')} | {fmt(s['prompt_ms'], '.0f')} | {fmt(s['warm_start_experts'], '.0f')} | {fmt(s['misses'], '.0f')} | "
                     f"{fmt(s['bytes_read'] and s['bytes_read'] / 2**30, '.2f')} | {fmt(s['peak_rss_anon_bytes'] and s['peak_rss_anon_bytes'] / 2**30, '.2f')} | "
                     f"{fmt(s['peak_cgroup_bytes'] and s['peak_cgroup_bytes'] / 2**30, '.2f')} | {s['swap_bytes']} | {s['oom_kills']} |")
    lines.append("")
    lines.append(f"Warm / cold time to first token: {fmt(ratio, '.2f')}.")
    benchlib.write_table(args.out, args.name, "\n".join(lines) + "\n", "bench-warm", differ, failed, what="first tokens differ")


if __name__ == "__main__":
    main()
