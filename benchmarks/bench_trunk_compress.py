"""The compressed trunk (docs/trunk-compress.md), measured, never asserted:

    python benchmarks/bench_trunk_compress.py --mid MODEL_DIR --trunk TRUNK_DIR
                                              [--runs 3] [--gen 8] [--json PATH]

1. ratio: trunk.k3z bytes / trunk.bin bytes on the trained demo model (package data) and
   on MODEL_DIR (packed + compressed into TRUNK_DIR when it holds no trunk.k3z), with the
   exponent entropy of the coded BF16 values (the ideal ratio is (8 + H) / 16);
2. decode: raw GB/s of the hx8 decoder per thread (the largest blocks, in memory, the
   thread's CPU time) and with every core decoding at once (wall), against the device's
   O_DIRECT rate read the way the trunk reads (4 MiB blocks, 4 in flight, trunk.bin);
3. the read path: all layers read once through the trunk's own code (4 reader threads,
   O_DIRECT), plain vs compressed, as delivered GB/s of layer bytes;
4. streamed s/token: the real `k3` process with nothing pinned (ring 2, cache 0.3 GB),
   K3_TRUNK_COMPRESS=off and =on alternating, median of --runs each, with the ids and the
   load average around every run.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_engine import device_bandwidth, prompt_ids, run_once  # noqa: E402

from k3engine.diskio import AlignedBuffer, open_for_streaming, parallel_read, pread_into  # noqa: E402
from k3engine.kernels._k3io import ReadPool  # noqa: E402
from k3engine.kernels import _k3z as Z  # noqa: E402
from k3engine.trunk import TrunkManifest, pack_trunk  # noqa: E402
from k3engine.trunk_compress import (CompressedReader, CompressedTrunk,  # noqa: E402
                                     compress_trunk, requested_mode)

STREAMED = ["--trunk-gb", "0", "--cache-gb", "0.3"]


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def exponent_entropy(trunk_dir: str) -> float:
    """Bits per exponent of every BF16 tensor the packer codes (from their histograms)."""
    m = TrunkManifest.load(trunk_dir)
    ct = CompressedTrunk.load(trunk_dir, m)
    hist = np.zeros(256, np.float64)
    fd = os.open(m.bin_path, os.O_RDONLY)
    try:
        for layer, c in zip(m.layers, ct.layers):
            for b in c.blocks:
                if b.codec == Z.CODEC_HX8:
                    buf = bytearray(b.raw_nbytes)
                    pread_into(fd, memoryview(buf), layer.file_off + b.raw_off)
                    hist += Z.hist(np.frombuffer(buf, np.uint16))
    finally:
        os.close(fd)
    p = hist[hist > 0] / hist.sum()
    return float(-(p * np.log2(p)).sum())


def ratio_row(name: str, trunk_dir: str) -> dict:
    m = TrunkManifest.load(trunk_dir)
    ct = CompressedTrunk.load(trunk_dir, m)
    coded = sum(b.raw_nbytes for c in ct.layers for b in c.blocks if b.codec == Z.CODEC_HX8)
    h = exponent_entropy(trunk_dir)
    row = dict(model=name, plain_bytes=m.total_bytes(), k3z_bytes=ct.stored_bytes,
               ratio=ct.stored_bytes / m.total_bytes(), coded_share=coded / m.total_bytes(),
               exponent_bits=h, ideal_coded_ratio=(8 + h) / 16)
    print(f"{name:28s} trunk.bin {row['plain_bytes'] / 1e6:9.1f} MB  trunk.k3z "
          f"{row['k3z_bytes'] / 1e6:9.1f} MB  ratio {row['ratio']:.3f} "
          f"({100 * (1 - row['ratio']):.1f} % fewer)  BF16 coded {100 * row['coded_share']:.1f} "
          f"% of the bytes, exponent entropy {h:.2f} bits (ideal {row['ideal_coded_ratio']:.3f})",
          flush=True)
    return row


def ensure_compressed(model: str, trunk_dir: str) -> None:
    if not os.path.exists(os.path.join(trunk_dir, "trunk.json")):
        t0 = time.monotonic()
        pack_trunk(model, trunk_dir)
        print(f"packed {trunk_dir} in {time.monotonic() - t0:.1f} s", flush=True)
    if not CompressedTrunk.present(trunk_dir):
        t0 = time.monotonic()
        ct = compress_trunk(trunk_dir)
        dt = time.monotonic() - t0
        print(f"compressed {trunk_dir} in {dt:.1f} s ({ct.raw_bytes / 1e6 / dt:.0f} MB/s of "
              f"layer bytes)", flush=True)


def decode_rates(trunk_dir: str, nblocks: int = 8, reps: int = 5) -> dict:
    m = TrunkManifest.load(trunk_dir)
    ct = CompressedTrunk.load(trunk_dir, m)
    blocks = sorted((b for c in ct.layers for b in c.blocks if b.codec == Z.CODEC_HX8),
                    key=lambda b: -b.raw_nbytes)[:nblocks]
    fd = os.open(ct.path, os.O_RDONLY)
    srcs = []
    for b in blocks:
        buf = np.empty(b.stored_nbytes, np.uint8)
        pread_into(fd, memoryview(buf), b.file_off)
        srcs.append((buf, np.empty(b.raw_nbytes, np.uint8)))
    os.close(fd)
    raw = sum(b.raw_nbytes for b in blocks)

    def one_pass() -> float:
        t0 = time.thread_time()
        for s, d in srcs:
            assert Z.decode_hx8(s, d) == Z.OK
        return time.thread_time() - t0
    per_thread = raw / statistics.median(one_pass() for _ in range(reps))
    cores = len(os.sched_getaffinity(0))
    start = threading.Barrier(cores)

    def worker(_):
        start.wait()
        for _ in range(reps):
            for s, _d in srcs:
                Z.decode_hx8(s, np.empty_like(_d))
    t0 = time.perf_counter()
    with ThreadPoolExecutor(cores) as pool:
        list(pool.map(worker, range(cores)))
    all_cores = cores * reps * raw / (time.perf_counter() - t0)
    return dict(block_raw_bytes=blocks[0].raw_nbytes, per_thread_bps=per_thread,
                cores=cores, all_cores_bps=all_cores)


def read_path(trunk_dir: str, io_threads: int = 4) -> dict:
    """Every layer once through the trunk's reads: plain (parallel 64 MiB chunks on the
    native readers) and compressed (blocks read + decoded on a pool of Python threads, as
    the trunk's reader thread does).  Wall seconds, O_DIRECT."""
    m = TrunkManifest.load(trunk_dir)
    reader = CompressedReader(CompressedTrunk.load(trunk_dir, m))
    fd, direct = open_for_streaming(m.bin_path)
    buf = AlignedBuffer(max(x.nbytes for x in m.layers))
    out = {}
    try:
        reads = ReadPool(io_threads)
        with ThreadPoolExecutor(io_threads) as pool:
            for kind in ("plain", "compressed", "plain", "compressed"):
                t0 = time.perf_counter()
                for L, layer in enumerate(m.layers):
                    if kind == "plain":
                        assert parallel_read(reads, fd, buf.view[:layer.nbytes],
                                             layer.file_off) == layer.nbytes
                    else:
                        assert reader.read_layer(pool, L, buf.view[:layer.nbytes]) is None
                out.setdefault(kind, []).append(m.total_bytes() / (time.perf_counter() - t0))
        reads.close()
    finally:
        buf.close()
        reader.close()
        os.close(fd)
    return dict(direct=direct, plain_bps=max(out["plain"]), compressed_bps=max(out["compressed"]),
                io_threads=io_threads)


def streamed(model: str, trunk_dir: str, runs: int, gen: int) -> dict:
    res = {"off": [], "on": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(runs):
            for mode in ("off", "on"):
                os.environ["K3_TRUNK_COMPRESS"] = mode
                before = load()
                r = run_once(model, ["--trunk", trunk_dir, *STREAMED], gen, tmp, prompt_ids(5))
                r["load_before"], r["load_after"] = before, load()
                res[mode].append(r)
                print(f"  run {i + 1} {mode:3s}: {r['spt']:.3f} s/token (steady "
                      f"{r['steady']:.3f}), {r['read_gb']:.2f} GB read/step (layer bytes), "
                      f"I/O {r['io']:.1f} %, load {before} -> {r['load_after']}", flush=True)
    os.environ.pop("K3_TRUNK_COMPRESS", None)
    rows = {}
    for mode, rs in res.items():
        rows[mode] = dict(s_per_token=statistics.median(r["spt"] for r in rs),
                          steady=statistics.median(r["steady"] for r in rs),
                          io_share=statistics.median(r["io"] for r in rs),
                          ids=rs[0]["ids"], loads=[(r["load_before"], r["load_after"])
                                                   for r in rs])
    same = {tuple(r["ids"]) for rs in res.values() for r in rs}
    rows["ids_identical"] = len(same) == 1
    print(f"streamed ({' '.join(STREAMED)}): plain {rows['off']['s_per_token']:.3f} s/token "
          f"(steady {rows['off']['steady']:.3f}), compressed {rows['on']['s_per_token']:.3f} "
          f"(steady {rows['on']['steady']:.3f}); ids identical across all {2 * runs} runs: "
          f"{rows['ids_identical']} ({rows['off']['ids']})", flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mid", required=True, help="a generated checkpoint (--dims mid)")
    ap.add_argument("--trunk", required=True, help="its packed trunk dir (packed and "
                                                   "compressed here when absent)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--gen", type=int, default=8)
    ap.add_argument("--json")
    a = ap.parse_args()
    requested_mode(None)
    print(f"load average at start: {load()} on {os.cpu_count()} CPUs", flush=True)
    out = {"load_start": load()}
    from k3engine.tools.demo import shipped_dir
    with tempfile.TemporaryDirectory() as tmp:
        d = os.path.join(tmp, "demo-trunk")
        pack_trunk(shipped_dir(), d)
        compress_trunk(d)
        out["ratio"] = [ratio_row("demo (trained, shipped)", d)]
    ensure_compressed(a.mid, a.trunk)
    out["ratio"].append(ratio_row(f"mid ({os.path.basename(os.path.abspath(a.mid))})", a.trunk))
    dec = decode_rates(a.trunk)
    rates, direct = device_bandwidth(os.path.join(a.trunk, "trunk.bin"))
    dev = rates[4]                       # MB/s at 4 reads in flight, as the trunk reads
    ratio = out["ratio"][-1]["ratio"]
    need = dev * 1e6 / (1 - ratio)
    print(f"decode: {dec['per_thread_bps'] / 1e9:.2f} GB/s per thread (blocks of "
          f"{dec['block_raw_bytes'] / 1e6:.1f} MB), {dec['all_cores_bps'] / 1e9:.2f} GB/s on "
          f"{dec['cores']} cores; device {dev / 1e3:.2f} GB/s ({'O_DIRECT' if direct else 'buffered'}"
          f", 4 MiB x 4); compressed outruns plain when decode x threads > device / (1 - "
          f"ratio) = {need / 1e9:.2f} GB/s", flush=True)
    out["decode"], out["device_bps"] = dec, dev * 1e6
    rp = read_path(a.trunk)
    print(f"read path, all layers once (4 reader threads, "
          f"{'O_DIRECT' if rp['direct'] else 'buffered'}): plain {rp['plain_bps'] / 1e9:.2f} "
          f"GB/s, compressed {rp['compressed_bps'] / 1e9:.2f} GB/s of layer bytes (best of 2)",
          flush=True)
    out["read_path"] = rp
    out["streamed"] = streamed(a.mid, a.trunk, a.runs, a.gen)
    out["load_end"] = load()
    print(f"load average at end: {out['load_end']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
