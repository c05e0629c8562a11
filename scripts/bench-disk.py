#!/usr/bin/env python3
"""The disk's ceiling for the pager: `sdq bench-disk` on the model file.

Random reads of expert-sized blocks (0.5, 1 and 2 MiB) with 1 to 32 in flight,
buffered (random-access advice, pages dropped after each read, as the pager
reads) and O_DIRECT, plus one sequential stream per size. The page cache is
dropped first (as root). Each measurement is run --runs times; the medians go
to a JSON file, a Markdown table and, if matplotlib is available, a PNG plot
of MiB/s against queue depth.

Usage: scripts/bench-disk.py [--model M] [--runs 3] [--seconds 2] [--out DIR]
"""
import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402 (scripts/benchlib.py)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def drop_page_cache():
    return benchlib.drop_page_cache("bench-disk", "buffered figures may include cached pages", fatal=False)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=os.path.join(ROOT, "models", "35b-a3b.gguf"))
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "bench"))
    a = ap.parse_args()
    sdq = os.path.join(ROOT, "target", "release", "sdq")
    if not os.path.exists(sdq):
        sys.exit("bench-disk: build first (cargo build --release)")
    if not os.path.exists(a.model):
        sys.exit(f"bench-disk: no model at {a.model} (sdq gen-model --preset 35b-a3b -o {a.model})")
    rows = {}
    for run in range(a.runs):
        drop_page_cache()
        p = subprocess.run([sdq, "bench-disk", a.model, "--seconds", str(a.seconds)], capture_output=True, text=True)
        if p.returncode != 0:
            sys.exit(f"bench-disk: sdq bench-disk failed:\n{p.stderr}")
        for line in p.stdout.splitlines():
            r = json.loads(line)
            rows.setdefault((r["mode"], r["size_bytes"], r["depth"]), []).append(r)
        print(f"bench-disk: run {run + 1} of {a.runs} done", flush=True)
    results = []
    for (mode, size, depth), rs in sorted(rows.items()):
        results.append({
            "mode": mode, "size_bytes": size, "depth": depth, "runs": len(rs),
            "mib_per_s": statistics.median(r["mib_per_s"] for r in rs),
            "latency_ms_p50": statistics.median(r["latency_ms_p50"] for r in rs),
            "latency_ms_p99": statistics.median(r["latency_ms_p99"] for r in rs),
        })
    best = max((r for r in results if r["mode"] != "sequential"), key=lambda r: r["mib_per_s"])
    doc = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"host": platform.node(), "cpus": os.cpu_count(), "kernel": platform.release()},
        "model": a.model, "model_bytes": os.path.getsize(a.model),
        "runs": a.runs, "seconds_per_measurement": a.seconds,
        "command": " ".join(["scripts/bench-disk.py"] + sys.argv[1:]),
        "best_parallel": best, "results": results,
    }
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "disk.json"), "w") as f:
        json.dump(doc, f, indent=2)
    sizes = sorted({r["size_bytes"] for r in results})
    depths = sorted({r["depth"] for r in results if r["mode"] != "sequential"})
    lines = [f"Disk under `{os.path.basename(a.model)}`: MiB/s, median of {a.runs} runs of {a.seconds:g} s each (p50 latency in ms).", ""]
    lines.append("| mode | size | " + " | ".join(f"QD {d}" for d in depths) + " |")
    lines.append("| --- | --- | " + " | ".join("---" for _ in depths) + " |")
    for mode in ["buffered", "direct"]:
        for s in sizes:
            cells = []
            for d in depths:
                r = next((r for r in results if (r["mode"], r["size_bytes"], r["depth"]) == (mode, s, d)), None)
                cells.append(f"{r['mib_per_s']:.0f} ({r['latency_ms_p50']:.1f})" if r else "")
            lines.append(f"| {mode} | {s >> 10} KiB | " + " | ".join(cells) + " |")
    seq = [r for r in results if r["mode"] == "sequential"]
    lines.append("")
    lines.append("Sequential, one stream: " + ", ".join(f"{r['size_bytes'] >> 10} KiB reads {r['mib_per_s']:.0f} MiB/s" for r in seq) + ".")
    with open(os.path.join(a.out, "disk.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("bench-disk: matplotlib not available; no plot")
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for mode, style in [("buffered", "-"), ("direct", "--")]:
        for s in sizes:
            pts = sorted((r["depth"], r["mib_per_s"]) for r in results if r["mode"] == mode and r["size_bytes"] == s)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", label=f"{mode} {s >> 10} KiB")
    for r in seq:
        ax.axhline(r["mib_per_s"], color="grey", linewidth=0.8, linestyle=":")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("reads in flight (queue depth)")
    ax.set_ylabel("MiB/s")
    ax.set_title("Random expert-sized reads from the model file (dotted: sequential)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(a.out, "disk.png"), dpi=110)
    print(f"bench-disk: wrote {a.out}/disk.json, disk.md, disk.png")


if __name__ == "__main__":
    main()
