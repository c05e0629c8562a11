#!/usr/bin/env python3
"""How peak memory moves with --sdq-reserve, inside enforced limits.

For each budget and reserve, runs llama-completion with that budget and reserve
under `sdq limit --memory BUDGET` (ctx 4096, ubatch 128) and records the arena,
peak anonymous RSS, the headroom left under the budget, whether the cgroup
OOM-killed the run, its major faults (file pages the limit pushed out and the
run had to read back) and decode speed. Writes JSON and a Markdown table;
compare with the default rule clamp(budget / 16, 128 MiB, 1024 MiB).

The arena has to fill for the reserve to matter: use a model with near-uniform
routing (`sdq gen-model --preset 35b-a3b --router-skew 0`), where one prompt
batch touches nearly every expert.

Usage: scripts/calibrate-reserve.py [--model M] [--budgets 4,8] [--reserves 64,128,256,512,1024]
                                 [--words 300] [--gen 32] [--timeout 600] [--out DIR]
       scripts/calibrate-reserve.py --from-json reserve.json --out DIR
"""
import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402 (scripts/benchlib.py)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.join(ROOT, "target", "release")
MIB = 1 << 20


def drop_page_cache():
    return benchlib.drop_page_cache("calibrate-reserve", "runs after the first start warm", fatal=False)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=os.path.join(ROOT, "models", "35b-a3b-flat.gguf"))
    ap.add_argument("--budgets", default="4,8")
    ap.add_argument("--reserves", default="64,128,256,512,1024")
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--words", type=int, default=300, help="prompt length in words")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per run")
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "bench"))
    ap.add_argument("--from-json", help="re-render the table from an earlier reserve.json")
    args = ap.parse_args()
    if args.from_json:
        rows = json.load(open(args.from_json))
        for r in rows:
            if r.get("mapped_weight_bytes") is None and r.get("arena_bytes"):
                # older rows: arena = budget - anon after load - mapped - reserve
                r["mapped_weight_bytes"] = (r["budget_gib"] * 2**30 - r["reserve_mib"] * MIB
                                            - r["arena_bytes"] - r["rss_anon_after_load_bytes"])
        os.makedirs(args.out, exist_ok=True)
        json.dump(rows, open(os.path.join(args.out, "reserve.json"), "w"), indent=1)
        render(rows, args.out)
        return
    os.makedirs(args.out, exist_ok=True)
    words = "harbour market river bridge tower garden school station library square".split()
    prompt = " ".join(words[i % len(words)] for i in range(args.words))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        pf = os.path.join(tmp, "prompt.txt")
        open(pf, "w").write(prompt)
        for b in [int(x) for x in args.budgets.split(",")]:
            for r in [int(x) for x in args.reserves.split(",")]:
                report, stats = benchlib.fresh_files(tmp, "limit.json", "stats.json")
                cmd = [os.path.join(BIN, "sdq"), "limit", "--memory", f"{b}G", "--report", report, "--",
                       os.path.join(BIN, "llama-completion"), "-m", args.model, "-f", pf, "-n", str(args.gen),
                       "--top-k", "1", "-no-cnv", "-t", "2", "-c", "4096", "-ub", "128", "--seed", "1",
                       "--ram-budget", f"{b}G", "--sdq-reserve", f"{r}M", "--sdq-stats", stats]
                drop_page_cache()
                p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
                timed_out = False
                try:
                    _, err = p.communicate(timeout=args.timeout)
                except subprocess.TimeoutExpired:
                    timed_out = True
                    p.send_signal(signal.SIGTERM)  # sdq limit forwards it and removes its cgroup
                    _, err = p.communicate()
                lim = json.load(open(report)) if os.path.exists(report) else {}
                st = json.load(open(stats)) if os.path.exists(stats) else {}
                m = re.search(r":\s+eval time =.*?([0-9.]+) tokens per second", err)
                peak = st.get("peak_rss_anon_bytes")
                row = {
                    "budget_gib": b, "reserve_mib": r, "exit_code": p.returncode, "timed_out": timed_out,
                    "oom_kills": lim.get("oom_kills"), "swap_bytes": lim.get("swap_bytes"),
                    "major_faults": lim.get("major_faults"), "peak_cgroup_bytes": lim.get("peak_bytes"),
                    "decode_tps": float(m.group(1)) if m else None,
                    "tokens": st.get("tokens"),
                    "arena_bytes": st.get("arena_bytes"), "slots": [c["slots"] for c in st.get("slot_classes", [])],
                    "rss_anon_after_load_bytes": st.get("rss_anon_after_load_bytes"),
                    "mapped_weight_bytes": st.get("mapped_weight_bytes"), "peak_rss_anon_bytes": peak,
                    "hit_rate": st.get("hit_rate"), "default_reserve_mib": min(max(b * 1024 // 16, 128), 1024),
                }
                rows.append(row)
                print(json.dumps(row), file=sys.stderr)
    json.dump(rows, open(os.path.join(args.out, "reserve.json"), "w"), indent=1)
    render(rows, args.out)


def render(rows, out):
    lines = ["| budget | reserve | arena | slots | anon after load | peak anon RSS | mapped weights | left over | hit % | OOM | swap | major faults | decode tok/s |",
             "| ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        gib = lambda v: "—" if v is None else f"{v / 2**30:.2f} GiB"
        # What the limit left for everything but anonymous memory and the mapped
        # weights: the rest of the page cache (embedding rows, binaries, reads
        # in flight) and the kernel's slack.
        headroom = "—"
        if r.get("peak_rss_anon_bytes") and r.get("mapped_weight_bytes") is not None:
            left = r["budget_gib"] * 2**30 - r["peak_rss_anon_bytes"] - r["mapped_weight_bytes"]
            headroom = f"{left / MIB:.0f} MiB"
        lines.append(f"| {r['budget_gib']} GiB | {r['reserve_mib']} MiB | {gib(r['arena_bytes'])} | {r['slots']} | "
                     f"{gib(r['rss_anon_after_load_bytes'])} | {gib(r['peak_rss_anon_bytes'])} | {gib(r.get('mapped_weight_bytes'))} | "
                     f"{headroom} | {'—' if r['hit_rate'] is None else format(100 * r['hit_rate'], '.1f')} | "
                     f"{r['oom_kills']} | {r['swap_bytes']} | {r['major_faults']} | "
                     f"{'—' if r['decode_tps'] is None else format(r['decode_tps'], '.2f')} |")
    md = "\n".join(lines) + "\n"
    open(os.path.join(out, "reserve.md"), "w").write(md)
    print(md)


if __name__ == "__main__":
    main()
