#!/usr/bin/env python3
"""A routing trace whose favourites move: a change of subject every N steps.

Reads a trace (`--sdq-trace` CSV) and writes it with each layer's experts
renumbered by a fresh random permutation every --period steps (the first
period as recorded). Within a period the routing is the recorded one, so
reuse from token to token stays as the model made it; across periods the
experts a layer favours change, which is what a policy's counts must
forget. Deterministic for a given --seed. For judging eviction policies
(`sdq replay`), not a model's routing.

Usage: scripts/shift-trace.py TRACE OUT [--period 16] [--seed 1]
"""
import argparse
import os
import random
import sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import trace_records  # noqa: E402

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("trace")
ap.add_argument("out")
ap.add_argument("--period", type=int, default=16)
ap.add_argument("--seed", type=int, default=1)
a = ap.parse_args()
rng = random.Random(a.seed)
experts = {}
perms = {}
records = list(trace_records(a.trace))
# Each layer's expert count: its header's, else one past the largest used.
for kind, fields, _ in records:
    if kind == "layer":
        experts[int(fields["layer"])] = int(fields.get("experts", 0))
    elif kind == "use":
        _, _, layer, expert, _ = fields
        if experts.get(layer, 0) <= expert:
            experts[layer] = expert + 1
with open(a.out, "w") as out:
    for kind, fields, line in records:
        if kind != "use":
            out.write(line + "\n")
            continue
        step, phase, layer, expert, weight = fields
        period = step // a.period
        if period > 0:
            if (period, layer) not in perms:
                n = experts[layer]
                p = list(range(n))
                rng.shuffle(p)
                perms[(period, layer)] = p
            expert = perms[(period, layer)][expert]
        out.write(f"{step},{phase},{layer},{expert},{weight}\n")
