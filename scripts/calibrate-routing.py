#!/usr/bin/env python3
"""Routing that looks trained: how close a generated model's routing comes to
a trained model's, as the eviction curves that decide a far-past-RAM run.

For each routing setting (router skew, context gain, recency, carry) and
each seed, generates a model (`sdq gen-model`), decodes greedily with the
pager on and records its routing (`sdq eval` with SDQ_TRACE_FILE), and
replays that trace with LRU and Bélády at 0.5-8 token cycles (`sdq replay
--cycles`). The trained trace (tests/fixtures/, from ../shared/data/traces/)
is replayed the same way; a setting's distance is the largest difference, in
points of decode hit rate, between the mean of its seeds' curves and the
trained trace's, over those eighteen figures (each seed's is printed too).
Writes docs/bench/NAME.json and NAME.md.

  scripts/calibrate-routing.py --arch gpt-oss --layers 16 --seeds 5,6,7 --configs 0,1,11,2 trained --name issue28-routing
  scripts/calibrate-routing.py --preset gpt-oss-120b --layers 4 --configs trained
"""
import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SDQ = os.path.join(ROOT, "target", "release", "sdq")
TRACE = os.path.join(ROOT, "tests", "fixtures", "gemma-4-26b-a4b.trace.csv")
WORK = os.path.join(ROOT, "models", "calibrate-routing")
PROMPT = "Explain how a mixture-of-experts model decides which experts handle each token."
CYCLES = [0.5, 0.75, 1.1, 1.5, 2, 3, 4, 6, 8]


def run(cmd, env=None):
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"calibrate-routing: {' '.join(cmd)} failed ({r.returncode}):\n{r.stderr[-2000:]}")
    return r.stdout


def curves(trace):
    """Decode hit % of LRU and Bélády at each of CYCLES."""
    out = json.loads(run([SDQ, "replay", trace, "--cycles", ",".join(map(str, CYCLES)), "--policy", "lru", "--json"]))
    lru, belady = [], []
    for r in out["results"]:
        lru.append(round(next(p for p in r["policies"] if p["policy"] == "lru")["decode_hit_pct"], 1))
        belady.append(round(r["belady"]["decode_hit_pct"], 1))
    return {"lru": lru, "belady": belady}


def distance(a, b):
    return max(abs(x - y) for k in ("lru", "belady") for x, y in zip(a[k], b[k]))


def one(a, cfg, seed):
    """Generates, traces and replays one setting at one seed: (the gen-model arguments, the curves)."""
    gen = [SDQ, "gen-model", "--preset", a.preset, "--seed", str(seed)]
    if a.preset == "tiny":
        gen += ["--experts", str(a.experts), "--top-k", str(a.top_k)]
        if a.arch:
            gen += ["--arch", a.arch]
    if a.layers:
        gen += ["--layers", str(a.layers)]
    if a.expert_type:
        gen += ["--expert-type", a.expert_type]
    if cfg == "trained":
        gen += ["--routing", "trained"]
        tag = "trained"
    else:
        skew, gain, recency, *carry = cfg.split(",")
        gen += ["--router-skew", skew, "--context-gain", gain, "--recency", recency]
        tag = f"s{skew}-g{gain}-r{recency}"
        if carry:
            gen += ["--carry", carry[0]]
            tag += f"-c{carry[0]}"
    base = (f"{a.preset}-{a.arch}" if a.arch else a.preset) + f"-seed{seed}"
    model = os.path.join(WORK, f"{base}-{tag}.gguf")
    trace = os.path.join(WORK, f"{base}-{tag}.trace.csv")
    run(gen + ["-o", model])
    env = dict(os.environ, SDQ_RAM_BUDGET="16G", SDQ_TRACE_FILE=trace)
    if a.temp > 0:
        run([os.path.join(ROOT, "target", "release", "llama-completion"), "-m", model, "-p", PROMPT, "-n", str(a.tokens),
             "-c", "1024", "--temp", str(a.temp), "--seed", "1", "-no-cnv", "--ignore-eos"], env=env)
    else:
        run([SDQ, "eval", "-m", model, "-p", PROMPT, "-n", str(a.tokens), "-c", "1024"], env=env)
    c = curves(trace)
    if not a.keep_models:
        os.remove(model)
    return " ".join(gen[1:]), c


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--arch", help="(tiny only) another architecture at tiny's geometry")
    ap.add_argument("--layers", type=int, help="cut the preset to this many layers")
    ap.add_argument("--expert-type", help="the experts' ggml type (gen-model --expert-type), e.g. q2_K for DeepSeek-V3 on this disk")
    ap.add_argument("--experts", type=int, default=128, help="(tiny only) experts per layer, as the trace's model")
    ap.add_argument("--top-k", type=int, default=6, help="(tiny only) experts per token, as the trace's model")
    ap.add_argument("--configs", nargs="+", default=["2,0.15,0", "1,1,0", "trained"],
                    help="SKEW,GAIN,RECENCY[,CARRY] settings, or 'trained' (gen-model --routing trained)")
    ap.add_argument("--tokens", type=int, default=128, help="decoded tokens, as the trace")
    ap.add_argument("--seeds", default="5",
                    help="comma-separated generator seeds: each setting is judged on the mean of their curves "
                         "(greedy decoding of random weights is chaotic: one seed's curves move by a few points)")
    ap.add_argument("--name", default="routing-calibration")
    ap.add_argument("--keep-models", action="store_true")
    ap.add_argument("--temp", type=float, default=0.0,
                    help="decode with llama-completion at this temperature (seed 1) instead of greedily")
    a = ap.parse_args()

    os.makedirs(WORK, exist_ok=True)
    trained = curves(TRACE)
    rows = [{"routing": "trained trace (Gemma 4 26B-A4B)", **trained, "distance": 0.0}]
    print(f"trained: LRU {trained['lru']} Bélády {trained['belady']}", flush=True)
    seeds = [int(x) for x in a.seeds.split(",")]
    for cfg in a.configs:
        per_seed = [one(a, cfg, seed) for seed in seeds]
        c = {k: [round(sum(p[1][k][i] for p in per_seed) / len(per_seed), 1) for i in range(len(CYCLES))] for k in ("lru", "belady")}
        d = distance(c, trained)
        row = {"routing": cfg, "gen_model": per_seed[0][0], **c, "distance": d}
        each = ""
        if len(seeds) > 1:
            row["seeds"] = [{"seed": seed, **p[1], "distance": distance(p[1], trained)} for seed, p in zip(seeds, per_seed)]
            each = " (seeds " + ", ".join(f"{r['seed']}: {r['distance']:.1f}" for r in row["seeds"]) + ")"
        rows.append(row)
        print(f"{cfg}: LRU {c['lru']} Bélády {c['belady']} (distance {d:.1f} points{each})", flush=True)

    out = os.path.join(ROOT, "docs", "bench", a.name)
    with open(out + ".json", "w") as f:
        json.dump({"cycles": CYCLES, "prompt": PROMPT, "tokens": a.tokens, "temp": a.temp, "seeds": seeds, "preset": a.preset, "arch": a.arch, "layers": a.layers, "expert_type": a.expert_type,
                   "rows": rows}, f, indent=1)
    with open(out + ".md", "w") as f:
        f.write(f"Decode hit % at {', '.join(map(str, CYCLES))} token cycles (`scripts/calibrate-routing.py`, preset {a.preset}"
                + (f", --arch {a.arch}" if a.arch else "") + (f", {a.layers} layers" if a.layers else "") + (f", {a.expert_type} experts" if a.expert_type else "") + (f", {a.tokens} tokens sampled at temperature {a.temp})\n\n" if a.temp > 0 else f", {a.tokens} greedy tokens)\n\n"))
        f.write("| routing | LRU | Bélády | largest difference (points) |\n| --- | --- | --- | --- |\n")
        for r in rows:
            f.write(f"| {r['routing']} | {', '.join(map(str, r['lru']))} | {', '.join(map(str, r['belady']))} | {r['distance']:.1f} |\n")
    print(f"calibrate-routing: wrote {out}.json and .md")


if __name__ == "__main__":
    main()
