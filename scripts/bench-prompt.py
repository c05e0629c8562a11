#!/usr/bin/env python3
"""Long prompts far past RAM: a prompt's seconds and expert reads, with a
llama_decode batch's ubatches computed together, layer by layer (the
default), against one ubatch at a time (SDQ_GROUP=1, the order before patch
0013), side by side in one session.

For each budget B (GiB), each disk rate R (MiB/s) and each prompt of N
tokens, every run starts with the page cache dropped and runs under
`sdq limit --memory B --read-rate R` (page cache counted, no swap, reads
throttled by the kernel):
  llama-completion -f PROMPT(N) -n --tokens --top-k 1 -c CTX -t 2
  --ram-budget B [-b 2048 for the "before" and "cut" rows, -b CTX for "whole"]
or, with --tool server, llama-server -c CTX -t 2 with the same flags, the
prompt's text sent as one user message to /v1/chat/completions (greedy,
--tokens tokens) and the server stopped after the answer.
The stats file gives the prompt's bytes read (`prompt.bytes_read`), the
bytes of the distinct experts it touched (`prompt.touched_bytes`: reading
each once), its groups, and the decode after it; llama.cpp's own timings
give the prompt's seconds. The bound is the larger of the touched bytes at
the disk's rate and the prompt's compute with every weight resident: stock
llama-completion on the same model and prompt with the page cache warm
(--compute-stock; the model must fit in RAM beside its repacked copy);
llama-bench under a budget holding every expert on two cuts of the model,
scaled to --depth paged layers (--compute-cuts A,B: for a model larger than
RAM); or --compute-json from an earlier run. Decode after the prompt is set
against its own bound the same way: its MiB a token at the disk's rate, or
the resident decode (tg32 on the cuts; with --decode-json, tg32 after a
context as long as the prompt, llama-bench -d, from --decode-depths),
whichever is slower. A line for a machine with --faster
times this one's compute is projected from the measured reads and compute,
and labelled as a projection.

Writes NAME.json, NAME.md and (with matplotlib) NAME.png into --out.

Usage: scripts/bench-prompt.py --model M [--budgets 6,8] [--read-rates 600,200] [--prompts 512,2048,8192]
                            [--runs 1] [--tokens 8] [--ctx 8448]
                            [--compute-stock | --compute-cuts A,B --depth N [--compute-budget 18] | --compute-json F]
                            [--ways before,cut,grouped,whole] [--tool server] [--faster 4] [--label TEXT] [--out docs/bench] [--name prompt]
       scripts/bench-prompt.py --compute-cuts A,B --depth N --decode-depths 522,2115,8520 --name NAME   (NAME-decode.json)
       scripts/bench-prompt.py --from-json docs/bench/NAME.json --name NAME [--compute-json J] [--decode-json D]   (the table and plot again)
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
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.join(ROOT, "target", "release")
MIB = 2**20
# pp512 runs on a cut, the fastest kept (cut_compute).
WARM_PP512 = 3


def prompt_file(tmp, n):
    """A prompt of a little under `n` tokens of made-up words (2.1 bytes a
    token: gpt-oss's tokenizer gives 2,334 tokens for 5,000 bytes of them;
    llama.cpp's timings count the tokens it really is)."""
    path = os.path.join(tmp, f"prompt-{n}.txt")
    x, words = 7, []
    while sum(len(w) + 1 for w in words) < n * 21 // 10:
        x = (x * 6364136223846793005 + 1442695040888963407) % 2**64
        words.append("".join(chr(ord("a") + (x >> (33 + 5 * i)) % 26) for i in range(2 + x % 6)))
    with open(path, "w") as f:
        f.write(" ".join(words))
    return path


def prompt_timing(err):
    """(ms, tokens) of llama.cpp's `prompt eval time` line."""
    m = re.search(r"prompt eval time =\s*([0-9.]+) ms /\s*([0-9]+) tokens", err)
    return (float(m.group(1)), int(m.group(2))) if m else (None, None)


def decode_tps(err):
    m = re.search(r"(?<![a-z] )eval time =.*?([0-9.]+) tokens per second", err)
    return float(m.group(1)) if m else None


def completion(model, prompt, tokens, ctx, extra):
    return [os.path.join(BIN, "llama-completion"), "-m", model, "-f", prompt, "-n", str(tokens), "--top-k", "1", "-no-cnv",
            "-t", "2", "-c", str(ctx), "--seed", "1"] + extra


def stats_figures(stats):
    """A run's prompt, groups and decode figures from its stats file ({} without one)."""
    s = benchlib.read_json(stats)
    if not s:
        return {}
    return dict(bytes_read=s["prompt"]["bytes_read"], touched_bytes=s["prompt"]["touched_bytes"], groups=s["prompt_groups"]["groups"],
                grouped_ubatches=s["prompt_groups"]["ubatches"], group_peak_bytes=s["prompt_groups"].get("peak_bytes"), arena_bytes=s.get("arena_bytes"),
                peak_rss_anon=s["peak_rss_anon_bytes"], decode_mib_per_token=s["decode"]["mib_read_per_token"], decode_seconds=s["decode"]["seconds"],
                decode_steps=s["decode"]["steps"], read_wait_seconds=s.get("read_wait_seconds"),
                prompt_read_wait_seconds=s["prompt"].get("read_wait_seconds"), convert_seconds=s.get("convert_seconds"))


def limited(cmd, budget, rate, tmp, env, timeout):
    report, stats = benchlib.fresh_files(tmp, "limit.json", "stats.json")
    benchlib.drop_page_cache("bench-prompt", "runs would not start cold", fatal=True)
    full = [os.path.join(BIN, "sdq"), "limit", "--memory", f"{budget}G", "--read-rate", f"{rate}M", "--report", report, "--"]
    full += cmd + ["--ram-budget", f"{budget}G", "--sdq-stats", stats]
    code, out, err = benchlib.run_session(full, timeout, env={**os.environ, **env})
    ms, n = prompt_timing(err)
    row = {"exit_code": code, "prompt_ms": ms, "prompt_tokens": n, "decode_tps": decode_tps(err), "text": out}
    if code is None:
        row["killed_after_s"] = timeout
    row.update(benchlib.limit_figures(report))
    row.update(stats_figures(stats))
    if code != 0:
        row["stderr_tail"] = err[-1500:]
    return row


def limited_server(model, prompt, tokens, ctx, extra, budget, rate, tmp, env, timeout):
    """As `limited`, for llama-server: the prompt file's text as one user
    message to /v1/chat/completions (greedy, `tokens` tokens), the server
    started cold in the limit and stopped after the answer (its stats
    file). The prompt's seconds and tokens are the server's own timings."""
    report, stats = benchlib.fresh_files(tmp, "limit.json", "stats.json")
    err_path = os.path.join(tmp, "server.err")
    benchlib.drop_page_cache("bench-prompt", "runs would not start cold", fatal=True)
    text = open(prompt).read()

    def cmd(port):
        return ([os.path.join(BIN, "sdq"), "limit", "--memory", f"{budget}G", "--read-rate", f"{rate}M", "--report", report, "--",
                 os.path.join(BIN, "llama-server"), "-m", model, "--host", "127.0.0.1", "--port", str(port), "-t", "2", "-c", str(ctx),
                 "--seed", "1", "--no-webui"] + extra + ["--ram-budget", f"{budget}G", "--sdq-stats", stats])

    row = {"prompt_ms": None, "prompt_tokens": None, "decode_tps": None, "text": None}

    def use(url):
        body = {"messages": [{"role": "user", "content": text}], "max_tokens": tokens, "top_k": 1, "seed": 1}
        v = benchlib.post_json(url + "/v1/chat/completions", body, timeout)
        t = v["timings"]
        row.update(prompt_ms=t["prompt_ms"], prompt_tokens=t["prompt_n"], decode_tps=t.get("predicted_per_second"),
                   text=v["choices"][0]["message"]["content"])

    code = benchlib.serve(row, cmd, err_path, timeout, use, env=env)
    row["exit_code"] = row["exit_code"] or (0 if row["prompt_ms"] is not None else code or 1)
    row.update(benchlib.limit_figures(report))
    row.update(stats_figures(stats))
    if row["exit_code"] != 0 and "stderr_tail" not in row:
        row["stderr_tail"] = open(err_path, errors="replace").read()[-1500:]
    return row


def stock_compute(model, prompt, tokens, ctx, extra):
    """Stock's prompt seconds with the page cache warm (the second of two runs)."""
    for _ in range(2):
        p = subprocess.run(completion(model, prompt, tokens, ctx, extra), capture_output=True, text=True, errors="replace", stdin=subprocess.DEVNULL)
    ms, _ = prompt_timing(p.stderr)
    if ms is None:
        sys.exit(f"bench-prompt: stock llama-completion gave no prompt timing:\n{p.stderr[-1500:]}")
    return ms / 1000


def resident_bench(cut, args, budget):
    """llama-bench's tests on `cut` under a budget holding every expert, the
    page cache warmed first."""
    with open(cut, "rb") as f:
        while f.read(64 * MIB):
            pass
    cmd = [os.path.join(BIN, "llama-bench"), "-m", cut] + args + ["-t", "2", "-r", "1", "--no-warmup", "-o", "json", "--ram-budget", f"{budget}G"]
    p = subprocess.run(cmd, capture_output=True, text=True, errors="replace", stdin=subprocess.DEVNULL)
    if p.returncode != 0:
        sys.exit(f"bench-prompt: {' '.join(cmd)} failed (exit {p.returncode}):\n{p.stderr[-1500:]}")
    return json.loads(p.stdout)


def cut_compute(cut, prompts, budget):
    """Seconds for each prompt of `prompts` tokens and ms a decoded token,
    resident. Where the budget holds the whole model the pager
    preloads every expert in the background once the first batch has run,
    and its reads and conversions take the same two cores: the second
    pp512 of a 1-layer cut ran 12.6-14.0 s against 9.3-9.6 s once the preload
    was done. So 512 tokens are measured three times and the fastest is
    kept (the preload only adds time), and the other prompts come after
    them (llama-bench keeps the model, and so the arena, across its tests)."""
    warm = [512] * WARM_PP512
    tests = resident_bench(cut, ["-p", ",".join(str(n) for n in warm + [n for n in prompts if n != 512]), "-n", "32"], budget)
    pp = [t for t in tests if t["n_prompt"] > 0]
    tg = [t for t in tests if t["n_gen"] > 0]
    runs512 = [512 / t["avg_ts"] for t in pp[:WARM_PP512]]
    out = {str(t["n_prompt"]): t["n_prompt"] / t["avg_ts"] for t in pp[WARM_PP512:]}
    out["512"], out["pp512_runs"] = min(runs512), runs512
    out["decode_ms"] = 1000 / tg[0]["avg_ts"]
    return out


def cut_decode_at(cut, depths, budget):
    """ms a decoded token on `cut`, resident, after a context of each of
    `depths` tokens: llama-bench -d fills the context untimed, then times 32
    tokens. Attention's share of a token grows with what it attends to (on
    DeepSeek-V3's MLA it is most of it past a few thousand tokens), so
    decode after a long prompt is held to the decode at its depth, not to
    an empty context's."""
    tests = resident_bench(cut, ["-p", "0", "-n", "32", "-d", ",".join(str(d) for d in depths)], budget)
    return {f"decode_ms@{t['n_depth']}": 1000 / t["avg_ts"] for t in tests if t["n_gen"] > 0}


def decode_ms_at(compute, tokens):
    """(ms, depth) of the resident decode measured nearest a context of
    `tokens` (within a tenth of it), else the empty context's (depth 0)."""
    depths = [int(k.split("@")[1]) for k in compute if k.startswith("decode_ms@")]
    near = [d for d in depths if abs(d - tokens) <= tokens / 10]
    if near:
        d = min(near, key=lambda d: abs(d - tokens))
        return compute[f"decode_ms@{d}"], d
    return compute.get("decode_ms"), 0


def scaled(cuts, depth, measure, what, layers_of):
    """`measure(cut)`'s figures on two cuts of one model, scaled linearly in
    their paged layers to `depth` (lists, such as the pp512 runs, are kept
    with the cuts only)."""
    points = []
    for cut in cuts:
        c = measure(cut)
        c["layers"] = layers_of(cut)
        points.append(c)
        print(f"bench-prompt: {what} of {os.path.basename(cut)} ({c['layers']} layers): {c}", file=sys.stderr)
    a, b = points
    out = {k: a[k] + (b[k] - a[k]) / (b["layers"] - a["layers"]) * (depth - a["layers"])
           for k in a if k != "layers" and not isinstance(a[k], list)}
    out.update(cuts=points, depth=depth)
    return out


def paged_layers(model):
    out = subprocess.run([os.path.join(BIN, "sdq"), "inspect", "--json", model], capture_output=True, text=True, check=True)
    return len(json.loads(out.stdout)["layers"])


def completed(row):
    """The runs of a row that gave a prompt time."""
    return [r for r in row["runs"] if r["exit_code"] == 0 and r["prompt_ms"]]


def derive(row, compute, faster):
    """The medians of a row's runs, its bound and ratio. The resident compute
    measured for N tokens is scaled to the prompt's own token count."""
    ok = completed(row)
    # A prompt whose compute is not measured yet (`--from-json` with
    # `--compute-json` derives it later) keeps its runs alone.
    if not ok or str(row["prompt"]) not in compute:
        return row
    med = lambda k: statistics.median(r[k] for r in ok)  # noqa: E731
    n, rate = row["prompt"], row["read_rate_mibs"]
    seconds, read, touched, tokens = med("prompt_ms") / 1000, med("bytes_read"), med("touched_bytes"), ok[0]["prompt_tokens"]
    reads_s, comp = touched / MIB / rate, compute[str(n)] * tokens / n
    bound = max(reads_s, comp)
    dec_ms, dec_depth = decode_ms_at(compute, tokens)
    if dec_ms and ok[0].get("decode_mib_per_token") is not None and med("decode_tps"):
        # Decode's own bound: its reads a token at the cap, or the resident
        # decode after as long a context (where measured), whichever is slower.
        dec_bound_tps = 1000 / max(med("decode_mib_per_token") / rate * 1000, dec_ms)
        row.update(decode_bound_tps=dec_bound_tps, decode_ratio=med("decode_tps") / dec_bound_tps, decode_bound_depth=dec_depth)
    row.update(seconds=seconds, tokens=tokens, read_mib=read / MIB, touched_mib=touched / MIB, reads_seconds=reads_s, compute_seconds=comp,
               bound_seconds=bound, ratio=seconds / bound, groups=med("groups"), decode_tps=med("decode_tps"),
               decode_mib_per_token=med("decode_mib_per_token"),
               # With the compute `faster` times as fast: grouped, the larger of
               # its reads (as many as it made: a prompt of several batches
               # reads again) and the compute, at the ratio measured; one
               # ubatch at a time, its reads and its compute one after the
               # other (at the ratio measured against that sum).
               projected_faster_seconds=(seconds / bound * max(read / MIB / rate, comp / faster) if "grouped" in row["way"] else
                                         seconds / (read / MIB / rate + comp) * (read / MIB / rate + comp / faster)))
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model")
    ap.add_argument("--budgets", default="6,8")
    ap.add_argument("--read-rates", default="600,200")
    ap.add_argument("--prompts", default="512,2048,8192")
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--ctx", type=int, default=8448)
    ap.add_argument("--compute-stock", action="store_true")
    ap.add_argument("--compute-json")
    ap.add_argument("--compute-cuts", help="two cuts of the model (gen-model --layers), resident under --compute-budget")
    ap.add_argument("--depth", type=int, help="the model's paged layers, for --compute-cuts")
    ap.add_argument("--compute-budget", type=float, default=18.0)
    ap.add_argument("--decode-depths", help="with --compute-cuts: measure the resident decode after these many tokens of context "
                    "(NAME-decode.json) and nothing else")
    ap.add_argument("--decode-json", help="a NAME-decode.json: decode after a prompt is held to the resident decode at its depth")
    ap.add_argument("--ways", default="before,cut,grouped", help="which of before, cut (-b 2048), grouped (default flags) and whole to run, in this order")
    ap.add_argument("--faster", type=float, default=4.0)
    # An 8k prompt on DeepSeek-V3 at 19 layers computes for about 55 minutes on
    # two cores before it reads anything twice: an hour cut such runs off.
    ap.add_argument("--timeout", type=int, default=3 * 3600, help="seconds a run may take before it is killed and recorded as such")
    ap.add_argument("--tool", choices=("completion", "server"), default="completion",
                    help="llama-completion -f PROMPT, or llama-server given the prompt as a chat message")
    ap.add_argument("--label", default="")
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "bench"))
    ap.add_argument("--name", default="prompt")
    ap.add_argument("--from-json", help="write NAME.md and NAME.png again from an earlier NAME.json (its runs kept)")
    a = ap.parse_args()
    if a.decode_depths:
        if not a.compute_cuts or not a.depth:
            sys.exit("bench-prompt: --decode-depths needs --compute-cuts A,B and --depth N")
        depths = [int(d) for d in a.decode_depths.split(",")]
        decode = scaled(a.compute_cuts.split(","), a.depth, lambda c: cut_decode_at(c, depths, a.compute_budget), "decode at depth", paged_layers)
        decode.update(date=datetime.date.today().isoformat(), machine=platform.node())
        json.dump(decode, open(os.path.join(a.out, f"{a.name}-decode.json"), "w"), indent=1)
        return
    # The decode at depth joins the compute figures the bounds are taken from.
    at_depth = {k: v for k, v in json.load(open(a.decode_json)).items() if k.startswith("decode_ms@")} if a.decode_json else {}
    if a.from_json:
        res = json.load(open(a.from_json))
        # A compute measured after the runs (the cuts of a model that did not
        # fit on the disk beside it) replaces the one they were run with.
        if a.compute_json:
            res["compute_seconds"] = json.load(open(a.compute_json))
        res["compute_seconds"].update(at_depth)
        compute = res["compute_seconds"]
        res["rows"] = [derive(r, compute, res["faster"]) for r in res["rows"]]
        json.dump(res, open(os.path.join(a.out, f"{a.name}.json"), "w"), indent=1)
        write_md(res, os.path.join(a.out, f"{a.name}.md"))
        plot(res, os.path.join(a.out, f"{a.name}.png"))
        return
    if not a.model and not a.compute_cuts:
        sys.exit("bench-prompt: --model is needed (or --from-json, or --compute-cuts to measure compute alone)")
    budgets = [float(b) for b in a.budgets.split(",")]
    rates = [float(r) for r in a.read_rates.split(",")]
    prompts = [int(n) for n in a.prompts.split(",")]
    tmp = tempfile.mkdtemp(prefix="bench-prompt-")
    files = {n: prompt_file(tmp, n) for n in prompts}

    if a.compute_json:
        compute = json.load(open(a.compute_json))
    elif a.compute_cuts:
        if not a.depth:
            sys.exit("bench-prompt: --compute-cuts needs --depth (the model's paged layers)")
        compute = scaled(a.compute_cuts.split(","), a.depth, lambda c: cut_compute(c, prompts, a.compute_budget), "compute", paged_layers)
        compute.update(date=datetime.date.today().isoformat(), machine=platform.node())
        json.dump(compute, open(os.path.join(a.out, f"{a.name}-compute.json"), "w"), indent=1)
    elif a.compute_stock:
        compute = {str(n): stock_compute(a.model, files[n], 1, a.ctx, []) for n in prompts}
        json.dump(compute, open(os.path.join(a.out, f"{a.name}-compute.json"), "w"), indent=1)
    else:
        sys.exit("bench-prompt: give --compute-stock, --compute-cuts or --compute-json (the bound needs the prompt's resident compute)")
    if not a.model:
        return
    compute.update(at_depth)

    # Before: one ubatch at a time and no prompt read ahead (SDQ_GROUP=1
    # SDQ_PREFETCH=0: the prompt path of the build before patch 0013), at
    # stock's -b 2048. After: the default flags (a batch's ubatches together;
    # llama-completion given -c and no -b gets -b of the context from sdq),
    # the same at -b 2048 (stock's cut, the default before sdq set -b), and
    # -b of the whole prompt given.
    all_ways = {"before": ("before: one ubatch at a time", {"SDQ_GROUP": "1", "SDQ_PREFETCH": "0"}, ["-b", "2048"]),
                "cut": ("grouped, -b 2048", {}, ["-b", "2048"]),
                "grouped": ("grouped, default flags", {}, []),
                "whole": ("grouped, -b of the prompt", {}, ["-b", str(a.ctx)])}
    unknown = [w for w in a.ways.split(",") if w not in all_ways]
    if unknown:
        sys.exit(f"bench-prompt: --ways takes {', '.join(all_ways)}, not {','.join(unknown)}")
    ways = [all_ways[w] for w in a.ways.split(",")]
    rows = []
    # The tokens each prompt turned out to be: -b of the whole prompt is the
    # default -b up to 2,048 tokens (a prompt of 2,048 nominal tokens may be
    # more in a model's tokenizer: DeepSeek's gives 2,115).
    tokens_of = {}
    for budget in budgets:
        for rate in rates:
            for n in prompts:
                for way, env, extra in ways:
                    whole = extra == ["-b", str(a.ctx)]
                    if whole and n <= 2048 and n in tokens_of and tokens_of[n] <= 2048:
                        continue
                    runs = []
                    for _ in range(a.runs):
                        if a.tool == "server":
                            r = limited_server(a.model, files[n], a.tokens, a.ctx, extra, budget, rate, tmp, env, a.timeout)
                        else:
                            r = limited(completion(a.model, files[n], a.tokens, a.ctx, extra), budget, rate, tmp, env, a.timeout)
                        runs.append(r)
                        if r.get("prompt_tokens"):
                            tokens_of[n] = r["prompt_tokens"]
                        ended = f"killed at --timeout {r['killed_after_s']} s" if "killed_after_s" in r else f"exit {r['exit_code']}"
                        print(f"bench-prompt: {budget:g} GiB, {rate:g} MiB/s, {n} tokens, {way}: {ended}, "
                              f"{(r['prompt_ms'] or 0) / 1000:.1f} s, read {r.get('bytes_read', 0) / MIB:.0f} MiB "
                              f"of {r.get('touched_bytes', 0) / MIB:.0f} touched", file=sys.stderr)
                    row = {"budget_gib": budget, "read_rate_mibs": rate, "prompt": n, "way": way, "runs": runs}
                    rows.append(derive(row, compute, a.faster))
                    # Written after every row: a long matrix stopped part way
                    # keeps what it measured.
                    res = {"date": datetime.date.today().isoformat(), "machine": platform.node(), "model": a.model, "label": a.label,
                           "tool": a.tool, "ctx": a.ctx, "compute_seconds": compute, "faster": a.faster, "rows": rows}
                    os.makedirs(a.out, exist_ok=True)
                    json.dump(res, open(os.path.join(a.out, f"{a.name}.json"), "w"), indent=1)
                    write_md(res, os.path.join(a.out, f"{a.name}.md"))
    plot(res, os.path.join(a.out, f"{a.name}.png"))


def write_md(res, path):
    lines = [f"# Long prompts: {os.path.basename(res['model'])} {res['label']}", "",
             f"{res['date']}, {res['machine']}, {'llama-server, the prompt as a chat message, ' if res.get('tool') == 'server' else ''}`-c {res['ctx']} -t 2`, each run cold in `sdq limit --memory B --read-rate R`.", "",
             "| budget | disk | prompt tokens | order | s | MiB read | MiB touched (once) | bound s (reads, compute) | ratio | groups |"
             f" decode after: tok/s, MiB/token, ×its bound | {res['faster']:g}x compute: s (projection) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in res["rows"]:
        if "seconds" not in r:
            ok = completed(r)
            what = f"{ok[0]['prompt_ms'] / 1000:.1f} (no compute yet)" if ok else "failed"
            lines.append(f"| {r['budget_gib']:g} GiB | {r['read_rate_mibs']:g} MiB/s | {r['prompt']} | {r['way']} | {what} | | | | | | | |")
            continue
        lines.append(f"| {r['budget_gib']:g} GiB | {r['read_rate_mibs']:g} MiB/s | {r['tokens']} | {r['way']} | {r['seconds']:.1f} | "
                     f"{r['read_mib']:.0f} | {r['touched_mib']:.0f} | {r['bound_seconds']:.1f} ({r['reads_seconds']:.1f}, {r['compute_seconds']:.1f}) | "
                     f"{r['ratio']:.2f} | {r['groups']:g} | {r['decode_tps'] or 0:.2f}, {r['decode_mib_per_token']:.0f}"
                     f"{', ' + format(r['decode_ratio'], '.2f') if 'decode_ratio' in r else ''}"
                     f"{' (bound at depth ' + str(r['decode_bound_depth']) + ')' if r.get('decode_bound_depth') else ''} | {r['projected_faster_seconds']:.1f} |")
    open(path, "w").write("\n".join(lines) + "\n")


def plot(res, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("bench-prompt: no matplotlib, no plot", file=sys.stderr)
        return
    rows = [r for r in res["rows"] if "seconds" in r]
    keys = sorted({(r["budget_gib"], r["read_rate_mibs"]) for r in rows})
    if not keys:
        return
    fig, axes = plt.subplots(1, len(keys), figsize=(4.5 * len(keys), 4), squeeze=False)
    for ax, (b, rate) in zip(axes[0], keys):
        sel = [r for r in rows if (r["budget_gib"], r["read_rate_mibs"]) == (b, rate)]
        for way in dict.fromkeys(r["way"] for r in sel):
            pts = sorted((r["tokens"], r["ratio"]) for r in sel if r["way"] == way)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=way)
        ax.axhline(1.15, color="grey", linestyle="--", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{b:g} GiB, disk {rate:g} MiB/s")
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("prompt seconds / bound")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
