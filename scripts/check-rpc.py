#!/usr/bin/env python3
"""Same text across machines, on the real geometries: a model split over two
rpc-server nodes on loopback (`--rpc A,B -ngl 99`), each node paging the
routed experts of its layers from its own copy under a budget below them
(inside its own `sdq limit`), against the same split with no budgets
(upstream's RPC: every weight sent to the nodes).

For each model (generated once into models/rpc-NAME.gguf):
  1. the split with no budgets: greedy text of --tokens tokens;
  2. a probe with room for every expert, for what each node holds beside its
     arena;
  3. each node under a budget of that plus its reserve plus half of its
     layers' experts (at least two layers' top-k), in
     `sdq limit --memory BUDGET`, the host under --host-budget: the text must
     be the same, byte for byte.
Exits non-zero on any difference. Writes NAME.json and NAME.md into --out.

Usage: scripts/check-rpc.py [--models 35b-a3b,gpt-oss-120b,deepseek-v3] [--tokens 32] [--out docs/bench] [--name rpc-same-text] [--keep]
"""
import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.join(ROOT, "target", "release")
MIB = 2**20

# The real geometries cut to a few layers (every node gets layers with experts).
MODELS = {
    "35b-a3b": ["--preset", "35b-a3b", "--layers", "4"],
    "gpt-oss-120b": ["--preset", "gpt-oss-120b", "--layers", "4", "--routing", "trained"],
    "deepseek-v3": ["--preset", "deepseek-v3", "--layers", "4", "--dense-layers", "1", "--expert-type", "q2_K", "--routing", "trained"],
}
PROMPT = "The history of the river crossing at the old town begins with"
RESERVE = 64 * MIB


def model_path(name):
    path = os.path.join(ROOT, "models", f"rpc-{name}.gguf")
    if not os.path.exists(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        subprocess.run([os.path.join(BIN, "sdq"), "gen-model", *MODELS[name], "-o", path], check=True)
    return path


def host(model, nodes, tokens, extra):
    cmd = [os.path.join(BIN, "llama-completion"), "-m", model, "-p", PROMPT, "-n", str(tokens), "--top-k", "1", "-no-cnv",
           "-t", "2", "-c", "1024", "--seed", "1", "--no-warmup", "--rpc", ",".join(n.endpoint for n in nodes), "-ngl", "99", *extra]
    # The text is compared as bytes: random weights make partial UTF-8.
    p = subprocess.run(cmd, capture_output=True, stdin=subprocess.DEVNULL)
    err = p.stderr.decode(errors="replace")
    if p.returncode != 0:
        logs = "\n".join(open(n.log, errors="replace").read() for n in nodes)
        sys.exit(f"check-rpc: {' '.join(cmd)} failed:\n{err[-3000:]}\n{logs[-3000:]}")
    return p.stdout, err


def check(name, tokens, work):
    model = model_path(name)
    row = {"model": name, "file": os.path.relpath(model, ROOT), "gen_model": MODELS[name], "bytes": os.path.getsize(model)}
    # 1. The split with no budgets.
    nodes = [benchlib.RpcNode(BIN, work, f"{name}-stock-{i}") for i in range(2)]
    stock, _ = host(model, nodes, tokens, [])
    for n in nodes:
        n.stop()
    # 2. A probe with room for every expert.
    nodes = [benchlib.RpcNode(BIN, work, f"{name}-probe-{i}", model=model, budget="16G", env={"SDQ_RESERVE_MB": str(RESERVE // MIB)}) for i in range(2)]
    probe, _ = host(model, nodes, tokens, ["--ram-budget", "8G"])
    budgets = []
    for n in nodes:
        n.stop()
        s = n.read_stats()
        if not s.get("paged"):
            # The split gave this node no layer with experts (the output only).
            budgets.append({"held": 0, "experts": 0, "arena_target": 0, "budget": 2 << 30})
            continue
        held = s["rss_anon_after_load_bytes"] + s.get("compute_untouched_bytes", 0)
        slot = [-(-c["expert_bytes"] // 4096) * 4096 for c in s["slot_classes"]]
        one_layer_top_k = sum(b * s["top_k"] for b in slot)
        all_experts = s["expert_bytes_total"]
        arena = max(all_experts // 2, 2 * one_layer_top_k)
        budgets.append({"held": held, "experts": all_experts, "arena_target": arena, "budget": held + RESERVE + arena + 8 * MIB})
    # 3. Each node under its budget, in its own memory limit.
    nodes = [benchlib.RpcNode(BIN, work, f"{name}-paged-{i}", model=model, budget=b["budget"], limit=b["budget"],
                              env={"SDQ_RESERVE_MB": str(RESERVE // MIB)}) for i, b in enumerate(budgets)]
    paged, paged_err = host(model, nodes, tokens, ["--ram-budget", "8G"])
    row["nodes"] = []
    for n, b in zip(nodes, budgets):
        report, log = n.stop()
        s = n.read_stats()
        if not s.get("paged"):
            row["nodes"].append({"budget_bytes": b["budget"], "experts_bytes": 0, "arena_bytes": 0, "bytes_read": 0, "hit_rate": 0.0,
                                 "peak_rss_anon_bytes": s["peak_rss_anon_bytes"], "summary": "no layer with experts"})
            continue
        row["nodes"].append({
            "budget_bytes": b["budget"], "experts_bytes": b["experts"], "arena_bytes": s["arena_bytes"],
            "bytes_read": s["bytes_read"], "hit_rate": s["hit_rate"], "peak_rss_anon_bytes": s["peak_rss_anon_bytes"],
            "limit_peak_bytes": (report or {}).get("peak_bytes"), "oom_kills": (report or {}).get("oom_kills"),
            "swap_bytes": (report or {}).get("swap_peak_bytes"), "summary": [l for l in log.splitlines() if l.startswith("sdq: hit")][-1:],
        })
    row["host_summary"] = [l for l in paged_err.splitlines() if "experts paged on rpc nodes" in l][-1:]
    row["same_text"] = paged == stock and probe == stock
    row["text"] = stock.decode(errors="replace")
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "bench"))
    ap.add_argument("--name", default="rpc-same-text")
    ap.add_argument("--keep", action="store_true", help="keep the generated models (GBs each) in models/")
    a = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="check-rpc-") as work:
        for name in a.models.split(","):
            row = check(name, a.tokens, work)
            rows.append(row)
            if not a.keep:
                os.remove(os.path.join(ROOT, "models", f"rpc-{name}.gguf"))
            print(f"check-rpc: {name}: {'same text' if row['same_text'] else 'DIFFERENT TEXT'}; "
                  + "; ".join(f"node {i}: arena {n['arena_bytes'] / MIB:.0f} of {n['experts_bytes'] / MIB:.0f} MiB of experts, "
                              f"{n['bytes_read'] / MIB:.0f} MiB read, budget {n['budget_bytes'] / MIB:.0f} MiB"
                              for i, n in enumerate(row["nodes"])), flush=True)
    out = {"date": datetime.date.today().isoformat(), "machine": platform.node(), "cpus": os.cpu_count(), "tokens": a.tokens,
           "prompt": PROMPT, "rows": rows}
    with open(os.path.join(a.out, a.name + ".json"), "w") as f:
        json.dump(out, f, indent=1)
    with open(os.path.join(a.out, a.name + ".md"), "w") as f:
        f.write(f"# Same text across two rpc-server nodes ({out['date']}, {a.tokens} greedy tokens)\n\n")
        f.write("| model | node | budget | its layers' experts | arena | read | hit % | peak anon RSS | same text |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- |\n")
        for r in rows:
            for i, n in enumerate(r["nodes"]):
                f.write(f"| {r['model']} ({' '.join(r['gen_model'])}) | {i} | {n['budget_bytes'] / MIB:.0f} MiB | {n['experts_bytes'] / MIB:.0f} MiB | "
                        f"{n['arena_bytes'] / MIB:.0f} MiB | {n['bytes_read'] / MIB:.0f} MiB | {100 * n['hit_rate']:.1f} | "
                        f"{n['peak_rss_anon_bytes'] / MIB:.0f} MiB | {'yes' if r['same_text'] else '**no**'} |\n")
    if not all(r["same_text"] for r in rows):
        sys.exit("check-rpc: the paged split's text differs from the split with no budgets")


if __name__ == "__main__":
    main()
