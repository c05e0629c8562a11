#!/usr/bin/env python3
"""Across machines: a model far past RAM over one and over two rpc-server
nodes, each paging its layers' routed experts from its own copy.

Each node runs in its own `sdq limit --memory BUDGET --read-rate R` with
`--ram-budget BUDGET` (on one machine they share its cores and its disk);
the host runs `llama-completion --rpc ... -ngl 99 --ram-budget HOST_BUDGET`
(it keeps the embeddings and the sampler). Two runs per setup, each cold:
  decode:  a short prompt, --tokens tokens: decode tok/s;
  prefill: a prompt of --prompt tokens, one token: prefill tok/s.
Per node (its stats file): its arena, token cycles (arena / one token's
experts of its layers), hit %, MiB read per token. The bytes crossing the
network: the loopback interface's bytes (/proc/net/dev) from the host's first
batch to its end, per token. A projection for two real machines on 1 and 10 GbE adds, per token,
the measured bytes at the link's rate and two round trips per node (a
paging node is asked after each graph whether it failed; the host then
reads the node's output), labelled as one.

Writes NAME.json and NAME.md into --out.

Usage: scripts/bench-rpc.py --model M [--budget 8G] [--read-rate 600M] [--nodes 1,2] [--tokens 32] [--prompt 512]
                         [--host-budget 8G] [--threads 1] [--name rpc-gpt-oss-120b]
"""
import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.join(ROOT, "target", "release")
MIB = 2**20
WORDS = "river stone lamp harbour letter garden bridge winter engine apple cloud market".split()


def prompt_text(n_tokens):
    """Made-up words, about `n_tokens` tokens (one a word, gpt-oss's
    tokenizer gave 179 tokens for 179 of them); the timings count them."""
    return " ".join(WORDS[(i * 7) % len(WORDS)] for i in range(n_tokens))


def loopback_bytes():
    """Bytes received on the loopback interface so far: every byte between
    the host and its nodes crosses it once (headers included)."""
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == "lo":
                return int(rest.split()[0])
    return 0


def host_run(model, nodes, prompt, tokens, host_budget, work):
    """llama-completion over `nodes`; returns its timings and the bytes its
    sockets carried from its first batch on (the loopback interface's bytes:
nothing else on this machine talks over it during a run)."""
    path = os.path.join(work, "prompt.txt")
    with open(path, "w") as f:
        f.write(prompt)
    cmd = [os.path.join(BIN, "llama-completion"), "-m", model, "-f", path, "-n", str(tokens), "--top-k", "1", "-no-cnv",
           "-t", "2", "-c", "4096", "--seed", "1", "--rpc", ",".join(n.endpoint for n in nodes), "-ngl", "99",
           "--ram-budget", host_budget]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, errors="replace", stdin=subprocess.DEVNULL)
    marks = {"start": None, "last": None}

    err_lines = []
    for line in p.stderr:
        err_lines.append(line)
        if marks["start"] is None and "generate:" in line:
            marks["start"] = loopback_bytes()
    out = p.stdout.read()
    p.wait()
    marks["last"] = loopback_bytes()
    err = "".join(err_lines)
    if p.returncode != 0:
        logs = "\n".join(open(n.log).read()[-2000:] for n in nodes)
        sys.exit(f"bench-rpc: {' '.join(cmd)} failed:\n{err[-3000:]}\n{logs}")
    pe = re.search(r"prompt eval time =\s*([\d.]+) ms /\s*(\d+) tokens", err)
    ev = re.search(r"\beval time =\s*([\d.]+) ms /\s*(\d+) runs", err)
    return {
        "prompt_tokens": int(pe.group(2)), "prompt_ms": float(pe.group(1)),
        "decode_tokens": int(ev.group(2)) if ev else 0, "decode_ms": float(ev.group(1)) if ev else 0.0,
        "network_bytes": (marks["last"] or 0) - (marks["start"] or 0), "text": out,
    }


def node_figures(stats, limit_report):
    top_k = stats["top_k"]
    token_bytes = sum(-(-c["expert_bytes"] // 4096) * 4096 * top_k * c["layers"] for c in stats["slot_classes"])
    tokens = stats["tokens"]["prompt"] + stats["tokens"]["generated"]
    return {
        "arena_bytes": stats["arena_bytes"], "experts_bytes": stats["expert_bytes_total"],
        "token_cycles": stats["arena_bytes"] / max(token_bytes, 1), "hit_rate": stats["hit_rate"],
        "decode_mib_per_token": stats.get("decode", {}).get("mib_read_per_token"),
        "mib_read_per_token": stats["bytes_read"] / MIB / max(tokens, 1),
        "layers": sum(c["layers"] for c in stats["slot_classes"]),
        "peak_rss_anon_bytes": stats["peak_rss_anon_bytes"],
        "limit_peak_bytes": (limit_report or {}).get("peak_bytes"), "swap_bytes": (limit_report or {}).get("swap_peak_bytes"),
    }


def setup(model, n_nodes, a, work, kind):
    benchlib.drop_page_cache("bench-rpc", "runs are not cold")
    nodes = [benchlib.RpcNode(BIN, work, f"n{n_nodes}-{kind}-{i}", model=model, budget=a.budget, limit=a.budget,
                              read_rate=a.read_rate, threads=a.threads) for i in range(n_nodes)]
    if kind == "decode":
        r = host_run(model, nodes, prompt_text(16), a.tokens, a.host_budget, work)
    else:
        r = host_run(model, nodes, prompt_text(a.prompt), 1, a.host_budget, work)
    r["nodes"] = []
    for n in nodes:
        report, _ = n.stop()
        r["nodes"].append(node_figures(n.read_stats(), report))
    return r


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--budget", default="8G")
    ap.add_argument("--read-rate", default="600M")
    ap.add_argument("--host-budget", default="8G")
    ap.add_argument("--nodes", default="1,2")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1, help="each node's threads (-t): the nodes share this machine's cores")
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "bench"))
    ap.add_argument("--name", default="rpc")
    a = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-rpc-") as work:
        for n in [int(x) for x in a.nodes.split(",")]:
            row = {"nodes": n}
            for kind in ("decode", "prefill"):
                row[kind] = setup(a.model, n, a, work, kind)
                d = row[kind]
                print(f"bench-rpc: {n} node(s), {kind}: prompt {d['prompt_tokens']} tok {d['prompt_ms'] / 1000:.1f} s, "
                      f"decode {d['decode_tokens']} tok {d['decode_ms'] / 1000:.1f} s, network {d['network_bytes'] / MIB:.1f} MiB; "
                      + "; ".join(f"node {i}: arena {x['arena_bytes'] / MIB:.0f} MiB, {x['token_cycles']:.1f} cycles, hit {100 * x['hit_rate']:.1f} %, "
                                  f"{x['mib_read_per_token']:.0f} MiB/token" for i, x in enumerate(d["nodes"])), flush=True)
            rows.append(row)
    for r in rows:
        d, p = r["decode"], r["prefill"]
        r["decode_tok_s"] = d["decode_tokens"] / (d["decode_ms"] / 1000) if d["decode_ms"] else None
        r["prefill_tok_s"] = p["prompt_tokens"] / (p["prompt_ms"] / 1000)
        r["network_bytes_per_decode_token"] = d["network_bytes"] / max(d["prompt_tokens"] + d["decode_tokens"], 1)
        r["network_bytes_per_prompt_token"] = p["network_bytes"] / max(p["prompt_tokens"], 1)
        # Projection (labelled): this run's decode time per token plus the
        # bytes at the link's rate and two round trips per node at the link's latency.
        for link, (rate, rtt) in {"1GbE": (125e6, 0.3e-3), "10GbE": (1250e6, 0.1e-3)}.items():
            if r["decode_tok_s"]:
                t = 1 / r["decode_tok_s"] + r["network_bytes_per_decode_token"] / rate + 2 * r["nodes"] * rtt
                r[f"projected_decode_tok_s_{link}"] = 1 / t
            t = 1 / r["prefill_tok_s"] + r["network_bytes_per_prompt_token"] / rate
            r[f"projected_prefill_tok_s_{link}"] = 1 / t
    out = {"date": datetime.date.today().isoformat(), "machine": platform.node(), "cpus": os.cpu_count(),
           "model": os.path.relpath(os.path.abspath(a.model), ROOT), "budget": a.budget, "read_rate": a.read_rate,
           "host_budget": a.host_budget, "threads_per_node": a.threads, "rows": rows}
    with open(os.path.join(a.out, a.name + ".json"), "w") as f:
        json.dump(out, f, indent=1)
    with open(os.path.join(a.out, a.name + ".md"), "w") as f:
        f.write(f"# {out['model']} over RPC nodes ({out['date']}; each node `sdq limit --memory {a.budget} --read-rate {a.read_rate}`, `-t {a.threads}`)\n\n")
        f.write("| nodes | decode tok/s | prefill tok/s | network per decode token | per node: arena, token cycles, hit %, MiB read/token | projected decode tok/s, 1 / 10 GbE |\n| --- | --- | --- | --- | --- | --- |\n")
        for r in rows:
            per = "; ".join(f"{x['arena_bytes'] / 2**30:.2f} GiB, {x['token_cycles']:.1f}, {100 * x['hit_rate']:.1f}, {x['mib_read_per_token']:.0f}"
                            for x in r["decode"]["nodes"])
            f.write(f"| {r['nodes']} | {r['decode_tok_s']:.2f} | {r['prefill_tok_s']:.1f} | {r['network_bytes_per_decode_token'] / 1024:.0f} KiB | {per} | "
                    f"{r.get('projected_decode_tok_s_1GbE', 0):.2f} / {r.get('projected_decode_tok_s_10GbE', 0):.2f} (projection) |\n")


if __name__ == "__main__":
    main()
