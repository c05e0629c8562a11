#!/usr/bin/env python3
"""Far past RAM: a model several times the budget, cold, inside an enforced
limit, against the bound the disk and the CPU set, and against stock.

For each budget B (GiB), every run starts with the page cache dropped and runs
under `sdq limit --memory B` (page cache counted, no swap):
  decode   llama-completion, a 10-token prompt, --tokens greedy tokens
           (--top-k 1), --ram-budget B; the stats file's `decode` phase gives
           MiB read per token, hit rate and seconds apart from the prompt's
  prefill  for each --prompts N: an N-token prompt and one token, with
           --sdq-trace, so that the bytes the prompt read can be set against
           the expert bytes each ubatch touched (each expert at most once
           per ubatch)
  stock    the decode command without a budget, with its defaults and with
           --no-repack, --stock-tokens tokens, given --stock-timeout seconds
The bound per decoded token is the larger of its miss bytes at the disk's
rate (--disk-mibs, or `sdq bench-disk` at the model's expert size, direct
I/O, 8 reads in flight) and its compute: --compute-ms, or measured with
--compute-cuts A,B (the same geometry cut to two depths, run fully resident
with stock's defaults and the page cache warm) and scaled linearly to
--depth paged (MoE) layers: a cut keeps the model's dense leading layers, so
DeepSeek-V3 cut to 19 layers is --depth 16. Both cuts, with stock's repacked
copy beside the page cache, must fit in RAM, or the figure is noise. The prefill bound is likewise its reads at the disk's rate
plus its compute at that depth.

Generated routing is not a trained model's, so each budget also gets a
projection: `sdq inspect --trace` replays a trained model's routing trace
(--trace, default the shared Gemma 4 trace) at the token cycles the budget's
arena holds, scaled to this geometry, and the MiB per token it implies gives
a decode rate at the same bound.

With --read-rate X, every run (and `sdq bench-disk`) reads the disks at
most X MiB/s (`sdq limit --read-rate`, the kernel's block throttle): a disk
of a known rate. Where the host caches a virtual disk, reads of blocks read
shortly before go faster than any measured rate, and the bound is then no
bound; under a cap below the disk's own rate it is one.

Compute can be measured once and reused: with --compute-cuts and no --model
it is written to NAME-compute.json; --compute-json reads it back (the cuts
need not be on disk beside the full model).

Writes NAME.json, NAME.md and (with matplotlib) NAME.png into --out.

Usage: scripts/bench-far.py --model M [--budgets 6,8,12] [--runs 2] [--tokens 32]
                         [--prompts 512,2048] [--stock-tokens 8] [--stock-timeout 900]
                         [--stock-budgets 8] [--stock-flags defaults,--no-repack]
                         [--disk-mibs X] [--read-rate MIBS] [--compute-cuts A.gguf,B.gguf --depth N | --compute-ms X | --compute-json F]
                         [--trace T] [--label TEXT] [--out docs/bench] [--name far]
"""
import argparse
import csv
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
import benchlib  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.join(ROOT, "target", "release")
PROMPT = "The history of the city began with a small harbour"
WORDS = "river mill bridge children boats apples letters town sea light stone garden".split()


def speed(err, what):
    m = re.search(rf"(?<![a-z] ){what} time =.*?([0-9.]+) tokens per second", err)
    return float(m.group(1)) if m else None


def inspect_json(model):
    """The model's accounting, `sdq inspect --json`: its paged layers, top_k, bytes."""
    out = subprocess.run([os.path.join(BIN, "sdq"), "inspect", "--json", model], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


READ_RATE = None  # --read-rate, MiB/s


def limit_cmd(budget, report):
    cap = ["--read-rate", f"{READ_RATE:g}M"] if READ_RATE else []
    return [os.path.join(BIN, "sdq"), "limit", "--memory", f"{budget}G"] + cap + ["--report", report, "--"]


def limited(cmd, budget, tmp, timeout, stats=None):
    report = os.path.join(tmp, "limit.json")
    for f in (report, stats):
        if f and os.path.exists(f):
            os.remove(f)
    benchlib.drop_page_cache("bench-far", "runs would not start cold", fatal=True)
    full = limit_cmd(budget, report) + cmd
    started = time.monotonic()
    code, out, err = benchlib.run_session(full, timeout)
    row = {"exit_code": code, "seconds": round(time.monotonic() - started, 1), "text": out,
           "decode_tps": speed(err, "eval"), "prompt_tps": speed(err, "prompt eval")}
    try:
        lim = json.load(open(report))
        row.update(peak_cgroup_gib=lim.get("peak_bytes", 0) / 2**30, swap_bytes=lim.get("swap_bytes"), oom_kills=lim.get("oom_kills"),
                   disk_read_bytes=lim.get("disk_read_bytes"))
    except (OSError, ValueError):
        pass
    if stats and os.path.exists(stats):
        row["stats"] = json.load(open(stats))
    if code != 0:
        row["stderr_tail"] = err[-1500:]
    return row


def completion(model, n, prompt_args, extra):
    return [os.path.join(BIN, "llama-completion"), "-m", model] + prompt_args + [
        "-n", str(n), "--top-k", "1", "-no-cnv", "-t", "2", "-c", "4096", "--seed", "1"] + extra


def touched_bytes_per_ubatch(trace_path):
    """Σ over prompt steps of the distinct experts each step used × their bytes."""
    sizes, touched = {}, {}
    with open(trace_path) as f:
        rows = []
        for line in f:
            if line.startswith("#"):
                m = re.search(r"layer=(\d+) bytes=(\d+)", line)
                if m:
                    sizes[int(m.group(1))] = int(m.group(2))
                continue
            rows.append(line)
    for r in csv.DictReader(rows):
        if r["phase"] == "p":
            touched.setdefault(int(r["step"]), set()).add((int(r["layer"]), int(r["expert"])))
    return sum(sizes[layer] for s in touched.values() for (layer, _) in s), len(touched)


def measure_disk(model, expert_bytes, tmp):
    size = f"{max(1, round(expert_bytes / 3 / 2**20))}M"  # one part (gate, up or down) per read
    # Under the runs' cap, if any: the rate the runs' reads can get.
    cap = limit_cmd(64, os.path.join(tmp, "disk-limit.json")) if READ_RATE else []
    out = subprocess.run(cap + [os.path.join(BIN, "sdq"), "bench-disk", model, "--sizes", size, "--depths", "8", "--modes", "direct",
                          "--seconds", "4"], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["mib_per_s"]


def measure_compute(cuts, depth, tokens, prompts):
    """Resident stock decode (ms/token) and prefill (ms per prompt) scaled from two cuts to `depth` layers."""
    points = []
    for cut in cuts:
        layers = len(inspect_json(cut)["layers"])
        row = {"layers": layers}
        for _ in range(2):  # the first run warms the page cache
            p = subprocess.run(completion(cut, tokens, ["-p", PROMPT], []), capture_output=True, text=True, errors="replace", stdin=subprocess.DEVNULL)
            row["decode_ms"] = 1000 / speed(p.stderr, "eval")
        for n in prompts:
            path = prompt_file(n)
            p = subprocess.run(completion(cut, 1, ["-f", path], []), capture_output=True, text=True, errors="replace", stdin=subprocess.DEVNULL)
            row[f"prefill_{n}_ms"] = n / speed(p.stderr, "prompt eval") * 1000
        points.append(row)
    (a, b) = points
    scale = lambda k: a[k] + (b[k] - a[k]) / (b["layers"] - a["layers"]) * (depth - a["layers"])  # noqa: E731
    if b["decode_ms"] <= a["decode_ms"]:
        sys.exit(f"bench-far: the deeper cut decoded no slower ({b['decode_ms']:.1f} against {a['decode_ms']:.1f} ms a token): "
                 "the slope per layer is lost in noise; cut further apart, or smaller so both stay resident")
    return {"cuts": points, "depth": depth, "decode_ms": scale("decode_ms"), **{f"prefill_{n}_ms": scale(f"prefill_{n}_ms") for n in prompts}}


def project(model, budget, trace, disk, compute):
    """A trained model's routing at this budget's token cycles (`sdq inspect --trace`)."""
    out = subprocess.run([os.path.join(BIN, "sdq"), "inspect", "--json", "-c", "4096", "--ram-budget", f"{budget}G", "--trace", trace,
                          "--read-rate", str(disk), model], capture_output=True, text=True)
    if out.returncode != 0:
        return {"error": out.stderr.strip()[-300:]}
    p = json.loads(out.stdout)["budget"].get("prediction") or {}
    mib = p.get("decode_mib_read_per_token")
    row = {"trace": os.path.basename(trace), "kind": p.get("kind"), "held_pct": 100 * p["decode_held_rate"] if p else None, "mib_per_token": mib}
    if mib:
        bound_ms = max(mib / disk * 1000, compute["decode_ms"] if compute else 0)
        row["bound_tps"] = 1000 / bound_ms
    return row


def prompt_file(n):
    path = os.path.join(tempfile.gettempdir(), f"bench-far-prompt-{n}.txt")
    # About one token per word with these tokenizers; the run reports the real count.
    with open(path, "w") as f:
        f.write(" ".join(WORDS[i % len(WORDS)] for i in range(n - 1)))
    return path


def main():
    global READ_RATE
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model")
    ap.add_argument("--label", default=None, help="the model as the tables name it (default: the file name)")
    ap.add_argument("--budgets", default="6,8,12")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompts", default="512,2048")
    ap.add_argument("--stock-tokens", type=int, default=8)
    ap.add_argument("--stock-timeout", type=float, default=900)
    ap.add_argument("--stock-budgets", default="8", help="budgets at which stock runs too")
    ap.add_argument("--stock-flags", default="defaults,--no-repack",
                    help="stock's configurations, comma-separated: defaults, or its flags (e.g. --no-repack alone where its defaults are known not to load)")
    ap.add_argument("--disk-mibs", type=float)
    ap.add_argument("--read-rate", type=float, help="cap every run's disk reads at this many MiB/s (sdq limit --read-rate)")
    ap.add_argument("--compute-cuts")
    ap.add_argument("--depth", type=int, help="the full model's paged (MoE) layers")
    ap.add_argument("--compute-ms", type=float)
    ap.add_argument("--compute-json")
    ap.add_argument("--trace", default=os.path.join(ROOT, "tests", "fixtures", "gemma-4-26b-a4b.trace.csv"))
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "bench"))
    ap.add_argument("--name", default="far")
    args = ap.parse_args()
    budgets = [float(b) if "." in b else int(b) for b in args.budgets.split(",")]
    stock_budgets = [float(b) if "." in b else int(b) for b in args.stock_budgets.split(",") if b]
    prompts = [int(p) for p in args.prompts.split(",") if p]
    stock_flags = [[] if c == "defaults" else c.split() for c in args.stock_flags.split(",") if c]
    if not args.model:
        if not (args.compute_cuts and args.depth):
            ap.error("--model, or --compute-cuts with --depth to measure compute alone")
        compute = measure_compute(args.compute_cuts.split(","), args.depth, args.tokens, prompts)
        compute.update(date=datetime.date.today().isoformat(), machine=f"{platform.machine()}, {os.cpu_count()} cores")
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, args.name + "-compute.json"), "w") as f:
            json.dump(compute, f, indent=1)
        print(json.dumps(compute, indent=1))
        return

    info = inspect_json(args.model)
    expert_bytes = max([layer["bytes_per_expert"] for layer in info.get("layers", [])], default=1)
    READ_RATE = args.read_rate
    with tempfile.TemporaryDirectory() as tmp:
        disk = args.disk_mibs or measure_disk(args.model, expert_bytes, tmp)
    compute = {"decode_ms": args.compute_ms} if args.compute_ms else None
    if args.compute_cuts:
        compute = measure_compute(args.compute_cuts.split(","), args.depth, args.tokens, prompts)
    if args.compute_json:
        compute = json.load(open(args.compute_json))
    res = {"date": datetime.date.today().isoformat(), "machine": f"{platform.machine()}, {os.cpu_count()} cores", "model": args.model,
           "label": args.label or os.path.basename(args.model), "file_bytes": info.get("file_bytes"),
           "expert_bytes_total": info.get("routed_expert_bytes"), "disk_mib_per_s": disk, "read_rate_mibs": READ_RATE, "compute": compute, "rows": []}
    with tempfile.TemporaryDirectory() as tmp:
        stats = os.path.join(tmp, "stats.json")
        trace = os.path.join(tmp, "trace.csv")
        for b in budgets:
            runs = []
            for i in range(args.runs):
                cmd = completion(args.model, args.tokens, ["-p", PROMPT], ["--ram-budget", f"{b}G", "--sdq-stats", stats])
                runs.append(limited(cmd, b, tmp, 3600, stats))
                print(f"bench-far: {b} GiB run {i + 1}: {runs[-1].get('decode_tps')} tok/s", file=sys.stderr)
            prefill = []
            for n in prompts:
                cmd = completion(args.model, 1, ["-f", prompt_file(n)], ["--ram-budget", f"{b}G", "--sdq-stats", stats, "--sdq-trace", trace])
                r = limited(cmd, b, tmp, 7200, stats)
                r["prompt_words"] = n
                if os.path.exists(trace):
                    r["touched_bytes"], r["ubatches"] = touched_bytes_per_ubatch(trace)
                prefill.append(r)
                print(f"bench-far: {b} GiB prompt {n}: {r.get('prompt_tps')} tok/s", file=sys.stderr)
            stock = []
            if b in stock_budgets:
                for flags in stock_flags:
                    r = limited(completion(args.model, args.stock_tokens, ["-p", PROMPT], flags), b, tmp, args.stock_timeout)
                    r["flags"] = " ".join(flags) or "defaults"
                    stock.append(r)
                    print(f"bench-far: stock {r['flags']} at {b} GiB: exit {r['exit_code']}, {r.get('decode_tps')} tok/s", file=sys.stderr)
            row = summarize(b, runs, prefill, stock, disk, compute, prompts)
            row["projection"] = project(args.model, b, args.trace, disk, compute)
            res["rows"].append(row)
    os.makedirs(args.out, exist_ok=True)
    base = os.path.join(args.out, args.name)
    with open(base + ".json", "w") as f:
        json.dump(res, f, indent=1)
    with open(base + ".md", "w") as f:
        f.write(render(res))
    plot(res, base + ".png")
    print(render(res))


def summarize(budget, runs, prefill, stock, disk, compute, prompts):
    ok = [r for r in runs if r["exit_code"] == 0 and "stats" in r]
    texts = {r["text"] for r in ok}
    dec = [r["stats"]["decode"] for r in ok]
    med = lambda v: statistics.median(v) if v else None  # noqa: E731
    s0 = ok[0]["stats"] if ok else {}
    cycle = sum(c["expert_bytes"] * c["layers"] * s0.get("top_k", 0) for c in s0.get("slot_classes", []))
    row = {"budget_gib": budget, "runs": len(runs), "ok": len(ok), "same_text": len(texts) <= 1, "text": ok[0]["text"] if ok else None,
           "arena_gib": s0.get("arena_bytes", 0) / 2**30, "token_cycles": s0.get("arena_bytes", 0) / cycle if cycle else None,
           "decode_tps": med([r["decode_tps"] for r in ok if r["decode_tps"]]),
           "decode_tps_runs": [r["decode_tps"] for r in ok],
           "decode_hit_pct": med([100 * d["hit_rate"] for d in dec]),
           # Hits less those a prefetch read for the token: what a replay counts.
           "decode_held_pct": med([100 * d["held_rate"] for d in dec if "held_rate" in d]),
           # What the reads got: above the disk's measured rate where the
           # host caches the virtual disk's blocks that were read before.
           "decode_read_mibs": med([d["mib_read_per_second"] for d in dec if "mib_read_per_second" in d]),
           "decode_mib_per_token": med([d["mib_read_per_token"] for d in dec]),
           "peak_cgroup_gib": med([r.get("peak_cgroup_gib") for r in ok if r.get("peak_cgroup_gib")]),
           "swap_bytes": max([r.get("swap_bytes") or 0 for r in runs], default=0),
           "oom_kills": sum(r.get("oom_kills") or 0 for r in runs)}
    if row["decode_mib_per_token"] is not None:
        disk_ms = row["decode_mib_per_token"] / disk * 1000
        bound_ms = max(disk_ms, compute["decode_ms"]) if compute else disk_ms
        row.update(disk_ms_per_token=disk_ms, bound_tps=1000 / bound_ms,
                   of_bound=row["decode_tps"] / (1000 / bound_ms) if row["decode_tps"] else None)
    row["prefill"] = []
    for r in prefill:
        st = r.get("stats", {}).get("prompt", {})
        p = {"prompt_words": r["prompt_words"], "exit_code": r["exit_code"], "prompt_tps": r.get("prompt_tps"),
             "tokens": st.get("tokens"), "seconds": st.get("seconds"), "bytes_read": st.get("bytes_read"),
             "touched_bytes": r.get("touched_bytes"), "ubatches": r.get("ubatches")}
        if p["bytes_read"] and p["touched_bytes"]:
            p["read_over_touched"] = p["bytes_read"] / p["touched_bytes"]
        key = f"prefill_{r['prompt_words']}_ms"
        if compute and key in compute and p["bytes_read"] is not None and p["seconds"]:
            p["bound_s"] = p["bytes_read"] / 2**20 / disk + compute[key] / 1000
            p["over_bound"] = p["seconds"] / p["bound_s"]
        row["prefill"].append(p)
    row["stock"] = [{"flags": r["flags"], "exit_code": r["exit_code"], "decode_tps": r.get("decode_tps"), "seconds": r["seconds"],
                     # Stock decodes fewer tokens: its text must begin sdq's (less a
                     # last character that may be a UTF-8 sequence cut short). sdq
                     # ran with its defaults, so only stock's defaults are the same
                     # flags: --no-repack runs other kernels, whose logits differ.
                     "same_text": bool(ok) and r["exit_code"] == 0 and ok[0]["text"].startswith(r["text"][:-8]),
                     "text": r["text"],
                     "stderr_tail": r.get("stderr_tail", "")[-300:]} for r in stock]
    best = max([s["decode_tps"] for s in row["stock"] if s["decode_tps"]], default=None)
    if best and row["decode_tps"]:
        row["vs_stock_best"] = row["decode_tps"] / best
    return row


def f(v, spec):
    return "—" if v is None else format(v, spec)


def render(res):
    c = res["compute"] or {}
    lines = [f"{res['label']}: {f((res['file_bytes'] or 0) / 1e9, '.1f')} GB, cold in an enforced limit on {res['machine']} ({res['date']}).",
             f"Disk {res['disk_mib_per_s']:.0f} MiB/s (direct, 8 reads in flight"
             + (f", every run's reads capped at {res['read_rate_mibs']:g} MiB/s by `sdq limit --read-rate`" if res.get("read_rate_mibs") else "")
             + f"); compute {f(c.get('decode_ms'), '.0f')} ms per token resident.", "",
             "| budget | arena | token cycles | decode hit % | held % | MiB read/token | read MiB/s | decode tok/s | bound tok/s | of bound | stock best tok/s | vs stock |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in res["rows"]:
        best = max([s["decode_tps"] for s in r["stock"] if s["decode_tps"]], default=None)
        stock = "—" if not r["stock"] else (f(best, ".3f") if best else "did not finish")
        lines.append(f"| {r['budget_gib']} GiB | {r['arena_gib']:.2f} GiB | {f(r['token_cycles'], '.2f')} | {f(r['decode_hit_pct'], '.1f')} | "
                     f"{f(r.get('decode_held_pct'), '.1f')} | {f(r['decode_mib_per_token'], '.0f')} | {f(r.get('decode_read_mibs'), '.0f')} | {f(r['decode_tps'], '.2f')} | {f(r.get('bound_tps'), '.2f')} | "
                     f"{f(r.get('of_bound'), '.2f')} | {stock} | {f(r.get('vs_stock_best'), '.0f')}× |")
    lines += ["", "| budget | prompt | tokens | prompt tok/s | read / touched per ubatch | seconds | bound s | over bound |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in res["rows"]:
        for p in r["prefill"]:
            lines.append(f"| {r['budget_gib']} GiB | {p['prompt_words']} | {f(p['tokens'], 'd')} | {f(p['prompt_tps'], '.2f')} | {f(p.get('read_over_touched'), '.3f')} | "
                         f"{f(p['seconds'], '.1f')} | {f(p.get('bound_s'), '.1f')} | {f(p.get('over_bound'), '.2f')} |")
    lines += ["", "Projection, not a measurement: the trained routing trace replayed at each budget's token cycles and scaled to this geometry "
              "(`sdq inspect --trace`), its MiB per token at the disk's rate against the same compute.", "",
              "| budget | trace | held % | MiB read/token | bound tok/s |", "| --- | --- | --- | --- | --- |"]
    for r in res["rows"]:
        p = r.get("projection") or {}
        lines.append(f"| {r['budget_gib']} GiB | {p.get('trace', '—')} | {f(p.get('held_pct'), '.1f')} | {f(p.get('mib_per_token'), '.0f')} | {f(p.get('bound_tps'), '.2f')} |")
    lines += ["", "Stock in the same limit:", ""]
    for r in res["rows"]:
        for s in r["stock"]:
            what = f"{s['decode_tps']:.3f} tok/s" if s["decode_tps"] else f"exit {s['exit_code']} after {s['seconds']} s"
            lines.append(f"- {r['budget_gib']} GiB, {s['flags']}: {what}")
    return "\n".join(lines) + "\n"


def plot(res, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    rows = [r for r in res["rows"] if r["decode_tps"]]
    x = [r["budget_gib"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(x, [r["decode_tps"] for r in rows], "o-", label="sdq decode")
    ax.plot(x, [r.get("bound_tps") for r in rows], "k--", label="bound (disk, compute)")
    ax.plot(x, [(r.get("projection") or {}).get("bound_tps") for r in rows], "s:", label="projection: trained routing")
    ax.set_xlabel("budget (GiB)")
    ax.set_ylabel("tok/s")
    ax.set_title(res["label"])
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
