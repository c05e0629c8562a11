#!/usr/bin/env python3
"""Time to first token for an image prompt: sdq in an enforced limit against stock.

llama-server with --mmproj answers an OpenAI-style chat request carrying a
PNG (one token, greedy). Each configuration starts a fresh server and sends
two requests, each with its own image: the first is the time to first token
of a server that has just started, the second of one that has answered
before. Configurations alternate run by run:
  sdq    --ram-budget B inside `sdq limit --memory B` (page cache counted, no
         swap), started cold (page cache dropped)
  stock  no budget and no limit, the model and the projector read into the
         page cache beforehand (the files cached)
The answers must be the same in every run of both. The time to first token
is the request's, from sending it to the answer; the server's own timings
(prompt ms, prompt tokens) and sdq's figures are kept per run.

The model and projector default to models/35b-a3b.gguf and
models/35b-a3b-mmproj.gguf. Without the projector both are generated
(`sdq gen-model --preset 35b-a3b --mmproj ...`: the target's geometry, whose
vocabulary then has the image tokens, and a SigLIP-so400m tower).

Writes NAME.json, NAME.md and (with matplotlib) NAME.png into --out.

Usage: scripts/bench-vision.py [--budget 8] [--runs 3] [--threads 2] [--model M --mmproj P]
                            [--out docs/bench] [--name vision] [--report-only]
"""
import argparse
import base64
import datetime
import json
import os
import platform
import statistics
import struct
import subprocess
import sys
import tempfile
import time
import zlib
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402 (scripts/benchlib.py)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.join(ROOT, "target", "release")
QUESTION = "What is in this picture? Answer in one sentence."


def png(width, height, seed):
    """An RGB PNG of a smooth colour pattern (no image library needed)."""
    rows = bytearray()
    for y in range(height):
        rows.append(0)
        for x in range(width):
            rows += bytes(((x * 3 + seed * 40) % 256, (y * 5 + seed * 90) % 256, ((x ^ y) + seed * 17) % 256))

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(bytes(rows), 6)) + chunk(b"IEND", b""))


def chat(url, image, timeout):
    """One greedy token for the question about `image`: (seconds, text, server timings)."""
    uri = "data:image/png;base64," + base64.b64encode(image).decode()
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": QUESTION}, {"type": "image_url", "image_url": {"url": uri}}]}],
            "max_tokens": 1, "top_k": 1, "temperature": 0, "cache_prompt": False}
    started = time.monotonic()
    v = benchlib.post_json(url + "/v1/chat/completions", body, timeout)
    seconds = time.monotonic() - started
    return round(seconds, 2), v["choices"][0]["message"]["content"], v.get("timings", {})


def serve(args, config, images, tmp):
    stats, report = benchlib.fresh_files(tmp, "stats.json", "limit.json")

    def cmd(port):
        c = [os.path.join(BIN, "llama-server"), "-m", args.model, "--mmproj", args.mmproj, "--port", str(port),
             "-t", str(args.threads), "-c", "4096", "-np", "1"]
        if config == "sdq":
            return ([os.path.join(BIN, "sdq"), "limit", "--memory", f"{args.budget}G", "--report", report, "--"] + c
                    + ["--ram-budget", f"{args.budget}G", "--sdq-stats", stats])
        return c

    if config == "sdq":
        benchlib.drop_page_cache("bench-vision", "runs would not start cold", fatal=True)
    else:
        for f in (args.model, args.mmproj):
            subprocess.run(["cat", f], stdout=subprocess.DEVNULL, check=True)
    row = {"config": config, "exit_code": 0, "requests": []}
    started = time.monotonic()

    def use(url):
        row["ready_s"] = round(time.monotonic() - started, 2)
        for image in images:
            seconds, text, timings = chat(url, image, args.timeout)
            row["requests"].append({"ttft_s": seconds, "text": text, "prompt_ms": timings.get("prompt_ms"),
                                    "prompt_tokens": timings.get("prompt_n")})

    code = benchlib.serve(row, cmd, os.path.join(tmp, f"{config}.err"), args.timeout, use)
    if not row["exit_code"] and code not in (0, -15):
        row["exit_code"] = code
        with open(os.path.join(tmp, f"{config}.err")) as err:
            row["stderr_tail"] = benchlib.stderr_tail(err)
    row.update(benchlib.limit_figures(report))
    row.update(benchlib.stats_figures(stats, ("hits", "misses", "bytes_read", "peak_rss_anon_bytes", "vm_swap_bytes", "arena_bytes",
                                              "projector_weights_bytes", "projector_compute_bytes")))
    return row


def med(values):
    v = [x for x in values if x is not None]
    return statistics.median(v) if v else None


def fmt(v, spec):
    return "—" if v is None else format(v, spec)


def plot(summary, path, title):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    labels = ["first request", "second request"]
    for i, s in enumerate(summary):
        ax.bar([x + i * 0.38 for x in range(2)], [s["first_ttft_s"] or 0, s["second_ttft_s"] or 0], 0.38, label=s["label"])
    ax.set_xticks([x + 0.19 for x in range(2)], labels)
    ax.set_ylabel("time to first token, s")
    ax.set_title(title, fontsize=9)
    ax.legend(loc="lower center", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=os.path.join(ROOT, "models", "35b-a3b.gguf"))
    ap.add_argument("--mmproj", help="default: the model's name with -mmproj")
    ap.add_argument("--budget", type=int, default=8, help="GiB (default 8)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--width", type=int, default=448)
    ap.add_argument("--height", type=int, default=336)
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "bench"))
    ap.add_argument("--name", default="vision")
    ap.add_argument("--report-only", action="store_true", help="rewrite NAME.md and NAME.png from NAME.json")
    args = ap.parse_args()
    if args.report_only:
        d = json.load(open(os.path.join(args.out, f"{args.name}.json")))
        report(args.out, args.name, d["meta"], d["summary"])
        return
    args.mmproj = args.mmproj or args.model.replace(".gguf", "-mmproj.gguf")
    if not os.path.exists(args.mmproj):
        print(f"bench-vision: no {args.mmproj}: generating it and the model with its image tokens", file=sys.stderr)
        subprocess.run([os.path.join(BIN, "sdq"), "gen-model", "--preset", "35b-a3b", "-o", args.model, "--mmproj", args.mmproj],
                       check=True)
    images = [png(args.width, args.height, 1), png(args.width, args.height, 2)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for run in range(args.runs):
            for config in ("sdq", "stock"):
                r = serve(args, config, images, tmp)
                r["run"] = run
                rows.append(r)
                print(f"run {run} {config}: ready {r.get('ready_s')} s, TTFT {[q['ttft_s'] for q in r['requests']]} s, "
                      f"exit {r['exit_code']}, misses {r.get('misses')}", file=sys.stderr)
    ok = [r for r in rows if r["exit_code"] == 0 and len(r["requests"]) == 2]
    answers = [[q["text"] for q in r["requests"]] for r in ok]
    differ = [f"{r['config']} run {r['run']}" for r, a in zip(ok, answers) if a != answers[0]]
    failed = [f"{r['config']} run {r['run']}" for r in rows if r not in ok]
    summary = []
    for config, label in (("sdq", f"sdq, {args.budget} GiB enforced, cold"), ("stock", "stock, files cached, no limit")):
        rs = [r for r in ok if r["config"] == config]
        first = [r["requests"][0] for r in rs]
        second = [r["requests"][1] for r in rs]
        summary.append({"config": config, "label": label, "runs": sum(r["config"] == config for r in rows), "ok": len(rs),
                        "ready_s": med([r.get("ready_s") for r in rs]),
                        "first_ttft_s": med([q["ttft_s"] for q in first]), "first_runs": [q["ttft_s"] for q in first],
                        "second_ttft_s": med([q["ttft_s"] for q in second]), "second_runs": [q["ttft_s"] for q in second],
                        "first_prompt_ms": med([q["prompt_ms"] for q in first]), "second_prompt_ms": med([q["prompt_ms"] for q in second]),
                        "prompt_tokens": med([q["prompt_tokens"] for q in first]),
                        "misses": med([r.get("misses") for r in rs]), "bytes_read": med([r.get("bytes_read") for r in rs]),
                        "peak_rss_anon_bytes": med([r.get("peak_rss_anon_bytes") for r in rs]),
                        "peak_cgroup_bytes": med([r.get("peak_cgroup_bytes") for r in rs]),
                        "projector_bytes": med([(r.get("projector_weights_bytes") or 0) + (r.get("projector_compute_bytes") or 0) for r in rs])
                        if config == "sdq" else None,
                        "swap_bytes": max([r.get("swap_bytes") or 0 for r in rs], default=0),
                        "oom_kills": sum(r.get("oom_kills") or 0 for r in rs)})
    sdq, stock = summary
    ratio = lambda k: sdq[k] / stock[k] if sdq[k] and stock[k] else None  # noqa: E731
    meta = {"machine": f"{platform.node()} {os.cpu_count()} cores, {platform.machine()}", "model": args.model, "mmproj": args.mmproj,
            "date": datetime.date.today().isoformat(), "runs": args.runs, "budget_gib": args.budget,
            "image": f"{args.width}x{args.height} PNG", "command": "scripts/bench-vision.py " + " ".join(sys.argv[1:]),
            "first_ttft_sdq_over_stock": ratio("first_ttft_s"), "second_ttft_sdq_over_stock": ratio("second_ttft_s"),
            "answers_differ": differ, "failed": failed}
    for r in rows:
        for q in r["requests"]:
            q.pop("text")
    os.makedirs(args.out, exist_ok=True)
    json.dump({"meta": meta, "summary": summary, "runs": rows}, open(os.path.join(args.out, f"{args.name}.json"), "w"), indent=1)
    report(args.out, args.name, meta, summary)
    if differ or failed:
        sys.exit(f"bench-vision: answers differ: {differ}; failed: {failed}")


def report(out, name, meta, summary):
    """NAME.md and NAME.png from the figures in NAME.json."""
    differ = meta["answers_differ"]
    lines = [f"Machine: {meta['machine']}. Model: `{meta['model']}` with `{meta['mmproj']}`. Date: {meta['date']}.",
             f"Command: `{meta['command']}`; medians of {meta['runs']} runs, alternating. Each run starts llama-server and sends two "
             f"chat requests, each with its own {meta['image']} and the same question, for one greedy token; the time to first "
             "token is the request's. Answers identical in every run: " + ("yes" if not differ else f"no ({differ})") + ".", "",
             "| config | ok | ready s | 1st request s | runs | 2nd request s | runs | prompt tokens | server's prompt ms (1st, 2nd) | misses | GiB read | peak anon RSS GiB | peak cgroup GiB | projector counted GiB | swap | OOM kills |",
             "| --- | ---: | ---: | ---: | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    g = lambda v: v and v / 2**30  # noqa: E731
    for s in summary:
        lines.append(f"| {s['label']} | {s['ok']}/{s['runs']} | {fmt(s['ready_s'], '.1f')} | {fmt(s['first_ttft_s'], '.2f')} | "
                     f"{', '.join(fmt(v, '.1f') for v in s['first_runs'])} | {fmt(s['second_ttft_s'], '.2f')} | "
                     f"{', '.join(fmt(v, '.1f') for v in s['second_runs'])} | {fmt(s['prompt_tokens'], '.0f')} | "
                     f"{fmt(s['first_prompt_ms'], '.0f')}, {fmt(s['second_prompt_ms'], '.0f')} | {fmt(s['misses'], '.0f')} | "
                     f"{fmt(g(s['bytes_read']), '.2f')} | {fmt(g(s['peak_rss_anon_bytes']), '.2f')} | {fmt(g(s['peak_cgroup_bytes']), '.2f')} | "
                     f"{fmt(g(s['projector_bytes']), '.2f')} | {s['swap_bytes']} | {s['oom_kills']} |")
    lines += ["", f"sdq / stock time to first token: first request {fmt(meta['first_ttft_sdq_over_stock'], '.2f')}, "
              f"second request {fmt(meta['second_ttft_sdq_over_stock'], '.2f')}."]
    md = "\n".join(lines) + "\n"
    open(os.path.join(out, f"{name}.md"), "w").write(md)
    plot(summary, os.path.join(out, f"{name}.png"), f"image prompt, {meta['image']}, {meta['machine']}")
    print(md)


if __name__ == "__main__":
    main()
