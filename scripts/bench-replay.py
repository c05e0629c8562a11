#!/usr/bin/env python3
"""Hit rates of every eviction policy and the offline optimum, from traces.

Each TRACE (a CSV from --sdq-trace) is replayed by `sdq replay --json` at
arena sizes given in token cycles (Σ over layers of top-k × bytes per
expert). The table gives, per trace and size, each policy's decode hit %,
Bélády's and "known frequency"'s (each expert's decode count told in
advance, not when it is used), and each one's share of the LRU → Bélády
gap; a summary gives the mean share over 1–4 cycles and the default's
lowest lead over LRU. The plot draws hit % against the arena size, one
panel per trace. Replay is deterministic, so one
run is the figure.

Writes NAME.json, NAME.md and (with matplotlib) NAME.png into --out.

Usage: scripts/bench-replay.py TRACE... [--cycles 0.5,1,1.5,2,3,4,6,8]
                            [--judged-from STEP] [--told-ahead 1,4,30]
                            [--out docs/bench] [--name replay] [--replot]
"""
import argparse
import datetime
import json
import os
import platform
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.join(ROOT, "target", "release")


def replay(trace, cycles, judged_from, told_ahead):
    told = ["--told-ahead", told_ahead] if told_ahead else []
    p = subprocess.run([os.path.join(BIN, "sdq"), "replay", trace, "--cycles", cycles, "--policy", "all", "--json",
                        "--judged-from", str(judged_from)] + told,
                       capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"bench-replay: sdq replay {trace}: {p.stderr.strip()}")
    return json.loads(p.stdout)


def plot(reports, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("bench-replay: matplotlib not installed; no plot", file=sys.stderr)
        return
    fig, axes = plt.subplots(1, len(reports), figsize=(4.2 * len(reports), 3.6), squeeze=False)
    for ax, (name, r) in zip(axes[0], reports.items()):
        xs = [x["token_cycles"] for x in r["results"]]
        # The first policy is the default: drawn last, on top, and thicker.
        names = [q["policy"] for q in r["results"][0]["policies"]]
        for i, p in reversed(list(enumerate(names))):
            style = {"color": "black", "linewidth": 2.2, "marker": "o", "markersize": 4, "zorder": 3} if i == 0 else {"marker": ".", "alpha": 0.8}
            ax.plot(xs, [next(q["decode_hit_pct"] for q in x["policies"] if q["policy"] == p) for x in r["results"]],
                    label=p + (" (default)" if i == 0 else ""), **style)
        ax.plot(xs, [x["known_frequency"]["decode_hit_pct"] for x in r["results"]], linestyle=":", color="gray", label="known frequency")
        ax.plot(xs, [x["belady"]["decode_hit_pct"] for x in r["results"]], linestyle="--", color="gray", label="Bélády")
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("arena (token cycles)")
        ax.set_ylim(0, 100)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("decode hit %")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("traces", nargs="*")
    ap.add_argument("--cycles", default="0.5,1,1.5,2,3,4,6,8")
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "bench"))
    ap.add_argument("--name", default="replay")
    ap.add_argument("--judged-from", type=int, default=0,
                    help="count steps from this one on (the earlier ones are replayed): a held-out part")
    ap.add_argument("--told-ahead", default="",
                    help="also replay the default told the next N batches' routing (sdq replay --told-ahead): a list of N")
    ap.add_argument("--replot", action="store_true", help="redraw NAME.png from NAME.json in --out, replaying nothing")
    args = ap.parse_args()
    if args.replot:
        reports = json.load(open(os.path.join(args.out, f"{args.name}.json")))["traces"]
        plot(reports, os.path.join(args.out, f"{args.name}.png"))
        return
    if not args.traces:
        ap.error("no TRACE given (one or more, or --replot)")
    reports = {os.path.splitext(os.path.basename(t))[0]: replay(t, args.cycles, args.judged_from, args.told_ahead) for t in args.traces}
    lines = [f"Machine: {platform.node()}. Date: {datetime.date.today().isoformat()}. "
             f"Command: `scripts/bench-replay.py {' '.join(sys.argv[1:])}`."
             + (f" Counted from step {args.judged_from} on." if args.judged_from else ""), "",
             "Decode hit % by policy, then each one's share (%) of the gap between LRU and Bélády.", ""]
    share = lambda v: "–" if v is None else f"{v:.0f}"
    names = [q["policy"] for q in next(iter(reports.values()))["results"][0]["policies"]]
    shared = [n for n in names if n != "lru"]
    lines.append("| trace | steps (p + d) | token cycle MiB | arena (cycles) | " + " | ".join(names) + " | known frequency | Bélády | "
                 + " | ".join(f"{n} gap %" for n in shared) + " | known frequency gap % |")
    lines.append("| --- | ---: | ---: | ---: |" + " ---: |" * (len(names) + 2 + len(shared) + 1))
    told = [f"told-{t['batches']}" for t in next(iter(reports.values()))["results"][0].get("told_ahead", [])]
    summary = ["", "Mean share (%) of the LRU → Bélády gap at 1–4 token cycles"
               + (" (told-N: the default told the next N batches' routing, not an online policy)" if told else "") + ":", "",
               "| trace | " + " | ".join(shared) + " | known frequency | " + "".join(f"{t} | " for t in told)
               + "lowest (default − lru) at 0.5–8 cycles, decode points |",
               "| --- |" + " ---: |" * (len(shared) + 2 + len(told))]
    for name, r in reports.items():
        mid = {n: [] for n in shared + ["known frequency"] + told}
        lowest = None
        for x in r["results"]:
            p = {q["policy"]: q for q in x["policies"]}
            lines.append(f"| {name} | {r['prompt_steps']} + {r['decode_steps']} | {r['token_cycle_bytes'] / 2**20:.1f} | {x['token_cycles']:.2f} | "
                         + " | ".join(f"{p[n]['decode_hit_pct']:.1f}" for n in names)
                         + f" | {x['known_frequency']['decode_hit_pct']:.1f} | {x['belady']['decode_hit_pct']:.1f} | "
                         + " | ".join(share(p[n]['decode_gap_share_pct']) for n in shared)
                         + f" | {share(x['known_frequency']['decode_gap_share_pct'])} |")
            if 1.0 <= x["token_cycles"] <= 4.0:
                for n in shared:
                    if p[n]["decode_gap_share_pct"] is not None:
                        mid[n].append(p[n]["decode_gap_share_pct"])
                if x["known_frequency"]["decode_gap_share_pct"] is not None:
                    mid["known frequency"].append(x["known_frequency"]["decode_gap_share_pct"])
                for t in x.get("told_ahead", []):
                    if t["decode_gap_share_pct"] is not None:
                        mid[f"told-{t['batches']}"].append(t["decode_gap_share_pct"])
            d = p[names[0]]["decode_hit_pct"] - p["lru"]["decode_hit_pct"]
            lowest = d if lowest is None else min(lowest, d)
        mean = lambda v: "–" if not v else f"{sum(v) / len(v):.1f}"
        summary.append(f"| {name} | " + " | ".join(mean(mid[n]) for n in shared) + f" | {mean(mid['known frequency'])} | "
                       + "".join(f"{mean(mid[t])} | " for t in told) + f"{lowest:+.1f} |")
    lines += summary
    md = "\n".join(lines) + "\n"
    os.makedirs(args.out, exist_ok=True)
    json.dump({"traces": reports}, open(os.path.join(args.out, f"{args.name}.json"), "w"), indent=1)
    open(os.path.join(args.out, f"{args.name}.md"), "w").write(md)
    plot(reports, os.path.join(args.out, f"{args.name}.png"))
    print(md)


if __name__ == "__main__":
    main()
