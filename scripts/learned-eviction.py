#!/usr/bin/env python3
"""How far an eviction score learned from the optimum's decisions goes.

Issue 31 asks the default to close 40 % of the LRU → Bélády gap on the part
of the trained trace it was not tuned on, and names, as one way there, a
score learned from Bélády's decisions (Hawkeye, LRB) over features an
online pager has. This measures that way offline, where any model can be
tried, before anything is built into the pager:

- each expert of each layer, at each batch, gets the features an online
  pager could keep (history only): batches since its last use, its counts
  aged over 4, 16, 64 and 256 batches, the part of a token until its layer
  runs, its layer, its router weight and rank at its last use, a
  transition score (how often it followed its layer's last experts) and a
  co-activation score (how often it came with the experts the current
  token took in the layer before its own, for the layers still to run);
- the label is Bélády's: is its next use farther than the arena's token
  cycles? (LRB's boundary);
- a gradient-boosted classifier (scikit-learn) gives each held expert the
  chance its next use is past the arena; the victim is the likeliest, the
  least recently used among equals;
- the trace is replayed with it, as `sdq replay` does (slot classes as the
  pager plans them, the batch's own experts never evicted), and its decode
  hit rate is set against LRU's and Bélády's from `sdq replay --json`.

Three ways to train it:

- `tuned`: on the steps before --judged-from only (what a policy tuned on
  the first part knows);
- `online`: every --retrain steps, on every step whose label is settled by
  then (what a pager that learns as it runs could know);
- `in-sample`: on the whole trace, the judged part included. No pager can
  know this: it bounds what these features can tell.

Needs `cargo build --release` (target/release/sdq) and the network once
(numpy and scikit-learn in a virtual environment under target/tmp).

Usage: scripts/learned-eviction.py [--trace T] [--judged-from 65]
                                [--cycles 1,1.5,2,3,4] [--retrain 16]
                                [--name issue31-learned-eviction]
Writes docs/bench/NAME.json and NAME.md.
"""
import argparse
import collections
import importlib.util
import json
import os
import subprocess
import sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import trace_records, venv_python  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORK = os.path.join(ROOT, "target", "tmp", "learned-eviction")
PINS = ["numpy==2.4.6", "scikit-learn==1.9.1"]

FEATURES = ["since", "count4", "count16", "count64", "count256", "until_run", "layer", "last_weight", "last_rank", "transition", "co_activation"]
FEATURE_SETS = {
    "recency and counts": FEATURES[:6],
    "+ transition, co-activation": FEATURES[:6] + ["transition", "co_activation"],
    "all": FEATURES,
}
HALF_LIVES = [4, 16, 64, 256]
NEVER = 400.0  # tokens: the distance of an expert not used again


def ensure_libraries():
    missing = [m for m in ("numpy", "sklearn") if importlib.util.find_spec(m) is None]
    if missing:
        if os.environ.get("SDQ_LEARNED_EVICTION_VENV"):
            sys.exit(f"learned-eviction: no {', '.join(missing)} in {WORK}/venv: remove it to install {' '.join(PINS)} again")
        py = venv_python("learned-eviction", WORK, PINS)
        os.environ["SDQ_LEARNED_EVICTION_VENV"] = "1"
        os.execv(py, [py] + sys.argv)


def read_trace(path):
    """Batches in order: (step, layer, {expert: weight}), and each layer's bytes."""
    layer_bytes, rows = {}, collections.defaultdict(dict)
    for kind, fields, _ in trace_records(path):
        if kind == "layer":
            layer_bytes[int(fields["layer"])] = int(fields["bytes"])
        elif kind == "use":
            step, _, layer, expert, weight = fields
            batch = rows[(step, layer)]
            batch[expert] = batch.get(expert, 0.0) + float(weight)
    return [(s, l, rows[(s, l)]) for s, l in sorted(rows)], layer_bytes


def features(batches, n_layers, n_experts, np):
    """Per batch t, per (layer, expert): the features as of just before t."""
    counts = np.zeros((len(HALF_LIVES), n_layers, n_experts))
    last = np.zeros((n_layers, n_experts))
    runs = np.zeros(n_layers)
    last_weight = np.zeros((n_layers, n_experts))
    last_rank = np.full((n_layers, n_experts), 9.0)
    transition = np.zeros((n_layers, n_experts, n_experts))
    co = np.zeros((n_layers, n_experts, n_experts))
    previous, token = {}, {}
    aging = 2 ** (-1 / 64)
    out = np.zeros((len(batches), n_layers, n_experts, len(FEATURES)), dtype=np.float32)
    for t, (step, layer, used) in enumerate(batches):
        x = out[t]
        x[..., 0] = np.where(last > 0, runs[:, None] - last + 1, 999.0)
        x[..., 1:5] = np.moveaxis(counts, 0, -1)
        x[..., 5] = (((np.arange(n_layers) - layer) % n_layers) / n_layers)[:, None]
        x[..., 6] = np.arange(n_layers)[:, None]
        x[..., 7] = last_weight
        x[..., 8] = last_rank
        for l2 in range(n_layers):
            if l2 in previous:
                row = transition[l2][list(previous[l2])].sum(0)
                if row.sum() > 0:
                    x[l2, :, 9] = row / row.sum() * len(previous[l2])
            if l2 >= layer and (step, l2 - 1) in token:
                row = co[l2][list(token[(step, l2 - 1)])].sum(0)
                if row.sum() > 0:
                    x[l2, :, 10] = row / row.sum() * len(token[(step, l2 - 1)])
        # batch t happens
        for c, h in zip(counts, HALF_LIVES):
            c[layer] *= 2 ** (-1 / h)
        runs[layer] += 1
        for rank, e in enumerate(sorted(used, key=lambda e: -used[e])):
            counts[:, layer, e] += 1
            last[layer, e], last_weight[layer, e], last_rank[layer, e] = runs[layer], used[e], rank
        if step > 0:  # a token's batch, not a prompt's union
            if layer in previous:
                transition[layer] *= aging
                for a in previous[layer]:
                    transition[layer][a, list(used)] += 1
            if (step, layer - 1) in token:
                co[layer] *= aging
                for a in token[(step, layer - 1)]:
                    co[layer][a, list(used)] += 1
            previous[layer] = set(used)
        token[(step, layer)] = set(used)
    return out


def distances(batches, n_layers, n_experts, np):
    """Per batch t, per (layer, expert): tokens from t to its next use after t."""
    nxt = np.full((len(batches), n_layers, n_experts), np.inf)
    ahead = np.full((n_layers, n_experts), np.inf)
    for t in range(len(batches) - 1, -1, -1):
        nxt[t] = ahead
        _, layer, used = batches[t]
        ahead[layer, list(used)] = t
    return np.minimum((nxt - np.arange(len(batches))[:, None, None]) / n_layers, NEVER)


def replay(batches, layer_slots, slots, judged_from, score):
    """Decode hit % of `score` (the highest goes first, the least recent among equals)."""
    held = {c: {} for c in slots}  # class → {key: last batch}
    hits = misses = 0
    for t, (step, layer, used) in enumerate(batches):
        c = layer_slots[layer]
        mine = held[c]
        counted = step >= max(judged_from, 1)
        for e in used:
            key = (layer, e)
            if key in mine:
                hits += counted
            else:
                misses += counted
                if len(mine) >= slots[c]:
                    victim = max((k for k in mine if not (k[0] == layer and k[1] in used)), key=lambda k: (score(t, k), -mine[k]))
                    del mine[victim]
            mine[key] = t
    return 100.0 * hits / max(hits + misses, 1)


def main():
    ensure_libraries()
    import numpy as np
    from sklearn.ensemble import HistGradientBoostingClassifier

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", default=os.path.join(ROOT, "tests", "fixtures", "gemma-4-26b-a4b.trace.csv"))
    ap.add_argument("--judged-from", type=int, default=65)
    ap.add_argument("--cycles", default="1,1.5,2,3,4")
    ap.add_argument("--retrain", type=int, default=16)
    ap.add_argument("--samples", type=int, default=300000)
    ap.add_argument("--name", default="issue31-learned-eviction")
    a = ap.parse_args()

    sdq = os.path.join(ROOT, "target", "release", "sdq")
    ref = json.loads(subprocess.run([sdq, "replay", a.trace, "--cycles", a.cycles, "--judged-from", str(a.judged_from), "--json"],
                                    check=True, capture_output=True, text=True).stdout)
    batches, layer_bytes = read_trace(a.trace)
    n_layers = max(layer_bytes) + 1
    n_experts = max(e for _, _, used in batches for e in used) + 1
    slot_of = {l: -(-b // 4096) * 4096 for l, b in layer_bytes.items()}
    x = features(batches, n_layers, n_experts, np)
    dist = distances(batches, n_layers, n_experts, np)
    steps = np.array([s for s, _, _ in batches])
    seen = x[..., 0] < 999
    flat = x.reshape(-1, len(FEATURES))
    step_of = np.broadcast_to(steps[:, None, None], seen.shape).ravel()
    rng = np.random.default_rng(0)

    def fit(rows, horizon, cols):
        rows = rng.choice(rows, min(len(rows), a.samples), replace=False)
        return HistGradientBoostingClassifier(max_iter=150, learning_rate=0.1, max_leaf_nodes=31, random_state=0).fit(
            flat[rows][:, cols], (dist.ravel()[rows] > horizon))

    def chances(way, horizon, cols):
        """Per batch, per (layer, expert): the chance its next use is past `horizon`."""
        p = np.full(seen.shape, 2.0)  # never used: first to go
        usable = seen.ravel() & (step_of > 0)
        if way == "in-sample":
            model = fit(np.flatnonzero(usable), horizon, cols)
            p = model.predict_proba(flat[:, cols])[:, 1].reshape(seen.shape)
        else:
            cuts = [a.judged_from] if way == "tuned" else range(a.judged_from, steps.max() + 1, a.retrain)
            for cut in cuts:
                # A label is known once its horizon has passed.
                model = fit(np.flatnonzero(usable & (step_of + np.ceil(horizon) < cut)), horizon, cols)
                part = (steps >= cut) if way == "tuned" else (steps >= cut) & (steps < cut + a.retrain)
                p[part] = model.predict_proba(x[part].reshape(-1, len(FEATURES))[:, cols])[:, 1].reshape(-1, n_layers, n_experts)
        return np.where(seen, p, 2.0)

    results = []
    for size in ref["results"]:
        c = size["token_cycles"]
        classes = {cl["slot_bytes"]: cl["slots"] for cl in size["slot_classes"]}
        layer_slots = {l: slot_of[l] for l in layer_bytes}
        lru = replay(batches, layer_slots, classes, a.judged_from, lambda t, k: 0.0)
        pol = {p["policy"]: p["decode_hit_pct"] for p in size["policies"]}
        row = {"token_cycles": c, "lru": pol["lru"], "lru_here": lru, "belady": size["belady"]["decode_hit_pct"],
               "default": pol["freq-auto"], "reuse": pol["reuse"], "learned": {}}
        for way in ["tuned", "online", "in-sample"]:
            for name, fs in FEATURE_SETS.items():
                p = chances(way, c, [FEATURES.index(f) for f in fs])
                hit = replay(batches, layer_slots, classes, a.judged_from, lambda t, k: p[t][k])
                row["learned"][f"{way}: {name}"] = hit
                print(f"{c:5.2f} cycles  {way:9} {name:28} {hit:5.1f} % (lru {pol['lru']:.1f}, belady {row['belady']:.1f})", flush=True)
        results.append(row)

    def share(hit, r):
        return 100.0 * (hit - r["lru"]) / (r["belady"] - r["lru"])
    mean = {k: sum(share(r["learned"][k], r) for r in results) / len(results) for k in results[0]["learned"]}
    for k in ["default", "reuse"]:
        mean[k] = sum(share(r[k], r) for r in results) / len(results)
    out = {"trace": os.path.relpath(a.trace, ROOT), "judged_from_step": a.judged_from, "retrain_steps": a.retrain,
           "samples": a.samples, "features": FEATURES, "feature_sets": FEATURE_SETS, "sizes": results, "mean_gap_share_pct": mean}
    base = os.path.join(ROOT, "docs", "bench", a.name)
    with open(base + ".json", "w") as f:
        json.dump(out, f, indent=1)
    md = [f"# {a.name}", "", f"`scripts/learned-eviction.py --trace {out['trace']} --judged-from {a.judged_from} --cycles {a.cycles} "
          f"--retrain {a.retrain}`: decode hits from step {a.judged_from} on; gap share = (hit − LRU) / (Bélády − LRU), "
          "LRU and Bélády from `sdq replay --json`.", "",
          "| way | " + " | ".join(f"{r['token_cycles']:g} cycles" for r in results) + " | mean gap share |",
          "| --- |" + " ---: |" * (len(results) + 1)]
    for k in ["default", "reuse"] + list(results[0]["learned"]):
        hits = [r[k] if k in r else r["learned"][k] for r in results]
        md.append(f"| {k} | " + " | ".join(f"{h:.1f}" for h in hits) + f" | {mean[k]:.1f} % |")
    md.append("| LRU (sdq replay; this script's replay) | " + " | ".join(f"{r['lru']:.1f}; {r['lru_here']:.1f}" for r in results) + " | 0 |")
    md.append("| Bélády | " + " | ".join(f"{r['belady']:.1f}" for r in results) + " | 100 % |")
    with open(base + ".md", "w") as f:
        f.write("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
