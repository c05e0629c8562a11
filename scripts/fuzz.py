#!/usr/bin/env python3
"""Runs sdq's cargo-fuzz targets (fuzz/fuzz_targets/) for a bounded time each,
as many side by side as the machine has cores.

  gguf_file  a model file through the preflight check (ggml's GGUF reader and
             sdq's range and split checks), `sdq inspect`'s accounting and
             the growth plan
  options    sdq's flags and environment variables, sizes and fault plans
  trace_file a routing trace as `sdq replay` reads it, then replayed at a few
             arena sizes through every policy and the Bélády bound
  hotset_file a hot set as --sdq-hotset reads it, written back and read again

The gguf_file corpus starts from small, valid qwen35moe GGUF files this script
writes (routed experts, recurrent layers, a split part), so the fuzzer starts
deep inside the format. libFuzzer runs with ASan (cargo fuzz's default), a
10 s per-input timeout and a 2 GiB RSS limit: a hang or a runaway allocation
counts as a finding, like a crash.

Writes target/fuzz/summary.json (per target: runs, seconds, corpus size,
finding); exits 1 on a finding, naming the input that reproduces it
(`cargo fuzz run TARGET ARTIFACT`).

Needs cargo-fuzz (`cargo install cargo-fuzz`). Uses the nightly toolchain if
rustup has one, else stable with RUSTC_BOOTSTRAP=1 (the sanitizer flags are
nightly-only options; stable ships the ASan runtime).

Usage: scripts/fuzz.py [--time SECS] [TARGET ...]
"""
import argparse
import concurrent.futures
import json
import os
import re
import struct
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGETS = ["gguf_file", "options", "trace_file", "hotset_file", "rpc_wire"]

# GGUF value types (ggml/include/gguf.h).
U32, F32, BOOL, STR, ARR = 4, 6, 7, 8, 9
# ggml types and their (block elements, block bytes).
Q8_0, F32T = 8, 0
BLOCK = {Q8_0: (32, 34), F32T: (1, 4)}


def gguf_string(s):
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def kv(key, ty, value):
    out = gguf_string(key) + struct.pack("<I", ty)
    if ty == U32:
        return out + struct.pack("<I", value)
    if ty == F32:
        return out + struct.pack("<f", value)
    if ty == BOOL:
        return out + struct.pack("<B", value)
    if ty == STR:
        return out + gguf_string(value)
    if ty == ARR:
        elem_ty, items = value
        out += struct.pack("<IQ", elem_ty, len(items))
        for it in items:
            out += struct.pack("<B", it) if elem_ty == BOOL else struct.pack("<I", it)
        return out
    raise ValueError(ty)


def model(layers=2, experts=4, top_k=2, embd=64, ff=32, split=None):
    """A small qwen35moe GGUF: routed experts (q8_0), a shared expert and
    linear-attention tensors in all but the last layer, zero data."""
    arch = "qwen35moe"
    keys = [
        kv("general.architecture", STR, arch),
        kv(f"{arch}.block_count", U32, layers),
        kv(f"{arch}.embedding_length", U32, embd),
        kv(f"{arch}.expert_count", U32, experts),
        kv(f"{arch}.expert_used_count", U32, top_k),
        kv(f"{arch}.expert_feed_forward_length", U32, ff),
        kv(f"{arch}.ssm.conv_kernel", U32, 4),
        kv(f"{arch}.ssm.state_size", U32, 32),
        kv(f"{arch}.ssm.group_count", U32, 2),
        kv(f"{arch}.ssm.inner_size", U32, 64),
        kv(f"{arch}.attention.recurrent_layers", ARR, (BOOL, [1] * (layers - 1) + [0])),
    ]
    if split:
        keys += [kv("split.no", U32, split[0]), kv("split.count", U32, split[1])]
    tensors = [("token_embd.weight", Q8_0, [embd, 16])]
    for i in range(layers):
        tensors += [
            (f"blk.{i}.ffn_gate_exps.weight", Q8_0, [embd, ff, experts]),
            (f"blk.{i}.ffn_up_exps.weight", Q8_0, [embd, ff, experts]),
            (f"blk.{i}.ffn_down_exps.weight", Q8_0, [ff, embd, experts]),
            (f"blk.{i}.ffn_gate_inp.weight", F32T, [embd, experts]),
            (f"blk.{i}.ffn_up_shexp.weight", Q8_0, [embd, ff]),
        ]
        if i < layers - 1:
            tensors.append((f"blk.{i}.ssm_a", F32T, [8]))
    infos, offset = b"", 0
    for name, ty, ne in tensors:
        n = 1
        for d in ne:
            n *= d
        per, size = BLOCK[ty]
        nbytes = n // per * size
        infos += gguf_string(name) + struct.pack("<I", len(ne)) + b"".join(struct.pack("<Q", d) for d in ne)
        infos += struct.pack("<IQ", ty, offset)
        offset += (nbytes + 31) // 32 * 32
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(keys)) + b"".join(keys) + infos
    head += b"\0" * (-len(head) % 32)
    return head + b"\0" * offset


def seeds(corpus):
    os.makedirs(corpus, exist_ok=True)
    for name, data in {
        "seed-2layers.gguf": model(),
        "seed-1layer-8experts.gguf": model(layers=1, experts=8, top_k=4),
        "seed-split-part.gguf": model(split=(0, 2)),
        "seed-header-only.gguf": model()[:512],
    }.items():
        with open(os.path.join(corpus, name), "wb") as f:
            f.write(data)
    traces = os.path.join(ROOT, "target", "fuzz", "corpus", "trace_file")
    os.makedirs(traces, exist_ok=True)
    rows = "".join(f"{s},{'p' if s == 0 else 'd'},{l},{(s * 7 + l * 3 + k) % 16},0.25\n"
                   for s in range(6) for l in range(3) for k in range(2 if s else 6))
    for name, text in {
        "seed-trace.csv": "# sdq routing trace: top_k=2\n" + "".join(f"# layer={l} bytes={4096 * (1 + l % 2)} experts=16 slot={8192 * (1 + l % 2)}\n" for l in range(3))
        + "step,phase,layer,expert,weight\n" + rows,
        "seed-plain.csv": "# layer=0 bytes=100\nstep,phase,layer,expert,weight\n0,d,0,1,0.5\n0,d,0,3,0.5\n1,d,0,1,1\n",
    }.items():
        with open(os.path.join(traces, name), "w") as f:
            f.write(text)
    hot = os.path.join(ROOT, "target", "fuzz", "corpus", "hotset_file")
    os.makedirs(hot, exist_ok=True)
    with open(os.path.join(hot, "seed-hot.txt"), "w") as f:
        f.write("# sdq hot set\n# layer=0 bytes=127488 experts=256\n# layer=1 bytes=110592 experts=256\n"
                "layer,expert,count,held\n0,17,3.469340209333812,1\n0,32,15.0876,1\n1,4,0.25,0\n1,200,0,1\n")
    wire = os.path.join(ROOT, "target", "fuzz", "corpus", "rpc_wire")
    os.makedirs(wire, exist_ok=True)

    def cmd(c, payload, declared=None):
        n = len(payload) if declared is None else declared
        return bytes([c, n & 255, (n >> 8) & 255, (n >> 16) & 255]) + payload
    rpc_tensor = struct.pack("<QIQ4I4II16iI10QQQQ64si", 1, 8, 0, 32, 4, 1, 1, 34, 34, 136, 136, 0,
                             *([0x31716473, 0, 100, 0, 4096, 0, 7, 0, 9, 0] + [0] * 6), 0, *([0] * 10), 0, 0, 0, b"blk.0.ffn_up_exps.weight", 0)
    for name, data in {
        "seed-alloc": cmd(0, struct.pack("<IQ", 0, 4096)) + cmd(3, struct.pack("<Q", 1)) + cmd(4, struct.pack("<Q", 1)),
        "seed-alignment-memory": cmd(1, struct.pack("<I", 0)) + cmd(2, struct.pack("<I", 0)) + cmd(11, struct.pack("<I", 0)) + cmd(15, b""),
        "seed-alloc-size-claim": cmd(13, struct.pack("<I", 0) + rpc_tensor + bytes(len(rpc_tensor) * 10)),
        "seed-status-truncated": cmd(17, struct.pack("<I", 0)) + cmd(6, b"\x01" * 40, declared=400),
        "seed-graph": cmd(10, struct.pack("<II", 0, 1) + struct.pack("<Q", 1) + struct.pack("<I", 1) + rpc_tensor),
    }.items():
        with open(os.path.join(wire, name), "wb") as f:
            f.write(data)
    opts = os.path.join(ROOT, "target", "fuzz", "corpus", "options")
    os.makedirs(opts, exist_ok=True)
    for i, text in enumerate([
        "--ram-budget\x008G\x00--sdq-reserve\x00512M\x00-np\x004\x00\x00\x00\x00eio@3,short@5,delay=2",
        "--ram-budget=6.5G\x00--cache-ram\x002048\x00--ctx-checkpoints\x002\x008G\x00256",
        "-m\x00x.gguf\x00--sdq-stats\x00/tmp/s.json\x00auto\x00\x00-1\x00eintr@1",
    ]):
        with open(os.path.join(opts, f"seed-{i}"), "wb") as f:
            f.write(text.encode())


def cargo_fuzz():
    if subprocess.run(["cargo", "fuzz", "--version"], capture_output=True).returncode != 0:
        sys.exit("fuzz: cargo-fuzz is not installed (cargo install cargo-fuzz)")
    nightly = subprocess.run(["rustup", "run", "nightly", "rustc", "--version"], capture_output=True).returncode == 0
    env = dict(os.environ)
    env.setdefault("SDQ_LLAMA_BUILD_DIR", os.path.join(ROOT, "target", "llama"))
    if nightly:
        return ["cargo", "+nightly", "fuzz"], env
    env["RUSTC_BOOTSTRAP"] = "1"
    return ["cargo", "fuzz"], env


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--time", type=int, default=60, help="seconds per target (default 60)")
    ap.add_argument("targets", nargs="*", default=TARGETS)
    a = ap.parse_args()
    cmd, env = cargo_fuzz()
    corpus_root = os.path.join(ROOT, "target", "fuzz", "corpus")
    seeds(os.path.join(corpus_root, "gguf_file"))
    artifacts = os.path.join(ROOT, "target", "fuzz", "artifacts")
    t0 = time.time()
    # All targets in one build when all run: cargo links them in parallel.
    for t in [None] if a.targets == TARGETS else a.targets:
        if subprocess.run(cmd + ["build", "--release"] + ([t] if t else []), cwd=ROOT, env=env).returncode != 0:
            sys.exit(f"fuzz: building {t or 'the targets'} failed")
    print(f"fuzz: built in {time.time() - t0:.0f} s", flush=True)
    # Each libFuzzer run is one single-threaded process: as many run side by
    # side as the machine has cores, so 4 targets of 30 s take 60 s on 2.
    def fuzz(t):
        corpus = os.path.join(corpus_root, t)
        os.makedirs(corpus, exist_ok=True)
        out = os.path.join(artifacts, t) + "/"
        os.makedirs(out, exist_ok=True)
        start = time.time()
        p = subprocess.run(
            cmd + ["run", "--release", t, corpus, "--",
                   f"-max_total_time={a.time}", "-max_len=65536", "-timeout=10",
                   "-rss_limit_mb=2048", "-close_fd_mask=3", "-print_final_stats=1",
                   f"-artifact_prefix={out}"],
            cwd=ROOT, env=env, capture_output=True, text=True)
        secs = time.time() - start
        log = p.stdout + p.stderr
        runs = re.findall(r"stat::number_of_executed_units:\s*(\d+)", log)
        artifact = re.findall(r"Test unit written to (\S+)", log)
        entry = {
            "runs": int(runs[-1]) if runs else None,
            "seconds": round(secs, 1),
            "corpus_files": len(os.listdir(corpus)),
            "exit": p.returncode,
            "finding": artifact[-1] if artifact else None,
        }
        status = "ok" if p.returncode == 0 else "FINDING"
        print(f"fuzz: {t}: {status}, {entry['runs']} runs in {secs:.0f} s, corpus {entry['corpus_files']} files", flush=True)
        if p.returncode != 0:
            tail = "\n".join(log.splitlines()[-40:])
            print(f"{tail}\nfuzz: reproduce with: {' '.join(cmd)} run {t} {entry['finding'] or ''}", file=sys.stderr, flush=True)
        return t, entry

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(os.cpu_count() or 1, len(a.targets)))) as pool:
        summary = dict(pool.map(fuzz, a.targets))
    found = any(e["exit"] != 0 for e in summary.values())
    os.makedirs(os.path.join(ROOT, "target", "fuzz"), exist_ok=True)
    with open(os.path.join(ROOT, "target", "fuzz", "summary.json"), "w") as f:
        json.dump({"seconds_per_target": a.time, "targets": summary}, f, indent=2)
    sys.exit(1 if found else 0)


if __name__ == "__main__":
    main()
