"""Routing made from a trained dense model's FFN (run by scripts/trained-routing.py).

Each layer's FFN neurons (rows of its gate matrix) are split into EXPERTS
groups of equal size by balanced k-means on the gate rows; a group is an
expert, and its router row is the mean of its neurons' gate rows. Each
token's recorded FFN input is scored against the router rows, and the top-k
groups are its experts (weights: softmax over the chosen scores). The
first --prompt tokens are one prompt step; each later token is one decoded
step. The model's last layer is left out (its FFN runs for the output
tokens only). Written in sdq's trace format, with an expert's bytes as a Q4_K
expert of (n_ff / EXPERTS) neurons would take (gate, up and down).
"""
import argparse
import os

import numpy as np

ap = argparse.ArgumentParser()
ap.add_argument("dump")
ap.add_argument("out")
ap.add_argument("--experts", type=int, default=32)
ap.add_argument("--top-k", type=int, default=4)
ap.add_argument("--prompt", type=int, default=32)
ap.add_argument("--seed", type=int, default=1)
a = ap.parse_args()
n_layer, n_embd, n_ff, n_tok = map(int, open(os.path.join(a.dump, "meta.txt")).read().split())
# llama.cpp computes the last layer's FFN only for the tokens whose logits
# are asked for (the last of each batch): that layer is left out.
n_layer -= 1
E, K = a.experts, a.top_k
size = n_ff // E
rng = np.random.default_rng(a.seed)


def balanced_kmeans(W, iters=12):
    """Equal-size groups: each round, neurons take the nearest centroid that still has room, closest pairs first."""
    norm = W / (np.linalg.norm(W, axis=1, keepdims=True) + 1e-9)
    cent = norm[rng.choice(len(W), E, replace=False)]
    for _ in range(iters):
        sim = norm @ cent.T  # n_ff x E
        order = np.argsort(-sim, axis=None)
        assign = -np.ones(len(W), dtype=int)
        room = np.full(E, size)
        for flat in order:
            i, e = divmod(int(flat), E)
            if assign[i] < 0 and room[e] > 0:
                assign[i] = e
                room[e] -= 1
        cent = np.stack([norm[assign == e].mean(axis=0) for e in range(E)])
        cent /= np.linalg.norm(cent, axis=1, keepdims=True) + 1e-9
    return assign


q4k_row = n_embd // 256 * 144  # bytes of one Q4_K row of n_embd
expert_bytes = 3 * size * q4k_row
routes = []
for il in range(n_layer):
    W = np.fromfile(os.path.join(a.dump, f"gate-{il}.f32"), dtype=np.float32).reshape(n_ff, n_embd)
    X = np.fromfile(os.path.join(a.dump, f"ffn-in-{il}.f32"), dtype=np.float32).reshape(n_tok, n_embd)
    assign = balanced_kmeans(W)
    router = np.stack([W[assign == e].mean(axis=0) for e in range(E)])
    scores = X @ router.T
    top = np.argsort(-scores, axis=1)[:, :K]
    routes.append((top, np.take_along_axis(scores, top, axis=1)))
with open(a.out, "w") as f:
    f.write(f"# sdq routing trace: top_k={K}\n")
    for il in range(n_layer):
        f.write(f"# layer={il} bytes={expert_bytes} experts={E}\n")
    f.write("step,phase,layer,expert,weight\n")
    steps = [(0, "p", range(min(a.prompt, n_tok)))] + [(t - a.prompt + 1, "d", [t]) for t in range(a.prompt, n_tok)]
    for step, phase, tokens in steps:
        for il in range(n_layer):
            top, s = routes[il]
            for t in tokens:
                w = np.exp(s[t] - s[t].max())
                w /= w.sum()
                for e, x in zip(top[t], w):
                    f.write(f"{step},{phase},{il},{int(e)},{x:.4f}\n")
print(f"{a.out}: {n_layer} layers, {E} experts of {size} neurons, top-{K}, {n_tok} tokens ({a.prompt} as the prompt)")
