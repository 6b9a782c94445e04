"""`k3 sim-cache TRACE`: replay a recorded expert trace at many cache sizes (SYSTEM §10.3).

Routing does not depend on the cache, so one run's `expert_trace.bin` (int32 LE pairs
(layer, expert), §6.8) yields the whole hit-rate-versus-capacity curve.  The LRU column is
replayed through `experts.LRUPolicy`, the very victim choice the engine makes; Belady
(optimal, offline) and PIN+LRU (the trace's hottest keys held for good) are ceilings that
use future knowledge; S3-FIFO (the later upstream default, §4.10, `experts.S3FIFOPolicy`,
the engine's with K3_CACHE_POLICY=s3fifo) is optional.  Output is the reference's
published table (§11.3).
"""
from __future__ import annotations

import argparse
import heapq
import sys
from dataclasses import dataclass

import numpy as np

from ..experts import TOKENS_DIVISOR, LRUPolicy, policy_class

EXPERT_BYTES = 17_547_264        # one routed expert of the released checkpoint
POOL = 92 * 896                  # routed experts in the released checkpoint
DISK_MBS = 1234.0                # measured random-cold read rate (§11.3)
CAPACITIES_GB = (8, 16, 32, 64, 128, 192, 256, 384, 512, 768, 1024, 1450)
MIN_SLOTS = 17                   # top-16 + 1 (§4.1)


class TraceError(ValueError):
    pass


def read_trace(path) -> np.ndarray:
    """[n, 2] int32 (layer, expert); an odd number of int32 is refused."""
    raw = np.fromfile(path, dtype="<i4")
    if raw.size % 2:
        raise TraceError(f"{path}: {raw.size} int32 values, not (layer, expert) pairs")
    return raw.reshape(-1, 2)


def trace_keys(pairs: np.ndarray) -> list[int]:
    """Key = (layer << 20) | expert, as the reference's replay."""
    return ((pairs[:, 0].astype(np.int64) << 20) | pairs[:, 1].astype(np.int64)).tolist()


# ---- policies ------------------------------------------------------------------------

def policy_hits(keys: list[int], cap: int, policy: str = "lru") -> int:
    """Hits of the engine's own replacement policy (experts.POLICIES) at cap slots."""
    return sum(map(policy_class(policy)(cap).access, keys))


def belady_hits(keys: list[int], cap: int) -> int:
    """Evict the resident key whose next use is furthest away (among equals the one
    resident longest); if the incoming key's next use is later than that, bypass it."""
    n = len(keys)
    nxt = [n] * n
    last: dict[int, int] = {}
    for i in range(n - 1, -1, -1):
        nxt[i] = last.get(keys[i], n)
        last[keys[i]] = i
    resident: dict[int, tuple[int, int]] = {}      # key -> (next use, admission order)
    heap: list[tuple[int, int, int]] = []          # (-next use, admission, key), lazy
    hits = admitted = 0
    for i, k in enumerate(keys):
        if k in resident:
            hits += 1
            order = resident[k][1]
            resident[k] = (nxt[i], order)
            heapq.heappush(heap, (-nxt[i], order, k))
            continue
        if len(resident) >= cap:
            while True:
                neg, order, v = heap[0]
                if resident.get(v) == (-neg, order):
                    break
                heapq.heappop(heap)                # stale entry
            if -neg < nxt[i]:
                continue                           # everything resident is needed sooner
            heapq.heappop(heap)
            del resident[v]
        resident[k] = (nxt[i], admitted)
        heapq.heappush(heap, (-nxt[i], admitted, k))
        admitted += 1
    return hits


def hottest(keys: list[int]) -> list[tuple[int, int]]:
    """(key, count) by count, equally hot keys in order of first appearance."""
    count: dict[int, int] = {}
    for k in keys:
        count[k] = count.get(k, 0) + 1
    return sorted(count.items(), key=lambda kv: -kv[1])     # stable: first seen first


def pin_lru_hits(keys: list[int], cap: int, npin: int, ranked=None) -> int:
    """The npin hottest keys of the trace held permanently (capped at cap - 1; the first
    touch is still a miss), LRU over the remaining max(cap - pinned, 1) slots."""
    npin = min(npin, cap - 1)
    hot = {k for k, _ in (ranked or hottest(keys))[:npin]}
    loaded: set[int] = set()
    policy = LRUPolicy(max(cap - len(hot), 1))
    hits = 0
    for k in keys:
        if k in hot:
            if k in loaded:
                hits += 1
            else:
                loaded.add(k)
        else:
            hits += policy.access(k)
    return hits


# ---- the table -------------------------------------------------------------------------

@dataclass
class Row:
    gb: float
    slots: int
    lru: float
    belady: float
    pin_lru: float
    gb_per_token: float
    sec_per_token: float
    s3fifo: float | None = None


def _gb_label(gb: float) -> str:
    return f"{gb:g} GB"


@dataclass(frozen=True)
class CurvePoint:
    slots: int
    lru: float            # % of requests hit, replayed through the engine's LRU
    belady: float         # % with Belady's optimal (offline) eviction: the ceiling
    s3fifo: float | None = None   # % through the engine's S3-FIFO, when asked for


def compulsory_ceiling(keys: list[int]) -> float:
    """% hit rate no policy beats at any size: every distinct expert misses once."""
    n = len(keys)
    return 100.0 * (n - len(set(keys))) / n if n else 0.0


def hit_curve(keys: list[int], slot_counts, s3fifo: bool = False) -> list[CurvePoint]:
    """The hit-rate curve over cache sizes (in slots): the computation behind both this
    command's table and K3 Studio's what-if view."""
    n = len(keys)
    return [CurvePoint(cap, 100.0 * policy_hits(keys, cap) / n,
                       100.0 * belady_hits(keys, cap) / n,
                       100.0 * policy_hits(keys, cap, "s3fifo") / n if s3fifo else None)
            for cap in slot_counts] if n else []


def capacity_rows(keys: list[int], capacities_gb=CAPACITIES_GB, expert_bytes: int = EXPERT_BYTES,
                  disk_mbs: float = DISK_MBS, s3fifo: bool = False) -> list[Row]:
    n = len(keys)
    ntok = max(n // TOKENS_DIVISOR, 1)
    ranked = hottest(keys)
    caps = [(gb, int(gb * 1e9 // expert_bytes)) for gb in capacities_gb]
    caps = [(gb, cap) for gb, cap in caps if cap >= MIN_SLOTS]
    rows = []
    for (gb, cap), pt in zip(caps, hit_curve(keys, [cap for _, cap in caps], s3fifo)):
        gb_tok = (n - pt.lru * n / 100.0) * expert_bytes / 1e9 / ntok
        rows.append(Row(gb, cap, pt.lru, pt.belady,
                        100.0 * pin_lru_hits(keys, cap, cap // 2, ranked) / n,
                        gb_tok, gb_tok * 1000.0 / disk_mbs, pt.s3fifo))
    return rows


def report(keys: list[int], capacities_gb=CAPACITIES_GB, expert_bytes: int = EXPERT_BYTES,
           disk_mbs: float = DISK_MBS, s3fifo: bool = False) -> list[str]:
    """The reference's report, line for line (§10.3, §11.3)."""
    n = len(keys)
    ranked = hottest(keys)
    uniq = len(ranked)
    ntok = max(n // TOKENS_DIVISOR, 1)
    reuse = n - uniq
    out = [f"trace: {n} requests, {uniq} distinct experts, about {ntok} token(s)",
           f"distinct experts touched: {uniq} of {POOL} ({100.0 * uniq / POOL:.2f}% of the pool)",
           f"if nothing were cached: {TOKENS_DIVISOR * expert_bytes / 1e9:.2f} GB per token",
           "",
           "hottest experts: " + ", ".join(f"L{k >> 20}/e{k & 0xFFFFF} x{v}"
                                           for k, v in ranked[:6]),
           f"total reuse: {reuse} of {n} requests are repeats ({100.0 * reuse / n:.1f}%)",
           ""]
    s3 = ["S3-FIFO"] if s3fifo else []
    out.append("%-9s %8s %9s" % ("CACHE", "SLOTS", "LRU")
               + "".join(" %9s" % c for c in s3 + ["BELADY", "PIN+LRU"])
               + " %12s %11s" % ("GB READ/TOK", "SEC/TOK"))
    rule = "-" * (76 + 10 * len(s3))
    out.append(rule)
    for r in capacity_rows(keys, capacities_gb, expert_bytes, disk_mbs, s3fifo):
        pcts = [r.lru] + ([r.s3fifo] if s3fifo else []) + [r.belady, r.pin_lru]
        out.append("%-9s %8d" % (_gb_label(r.gb), r.slots)
                   + "".join(" %8.2f%%" % p for p in pcts)
                   + " %12.2f %11.2f" % (r.gb_per_token, r.sec_per_token))
    out += [rule,
            f"SEC/TOK is expert I/O only, at the measured {disk_mbs:.0f} MB/s random-cold rate.",
            "It excludes compute, which overlaps with it in a real serving loop.",
            "BELADY and PIN+LRU both use future knowledge, so they are ceilings rather",
            "than achievable policies. LRU is what the engine actually does.",
            f"compulsory misses: {uniq} (every expert must be read at least once), a ceiling of",
            f"{compulsory_ceiling(keys):.2f}% hit rate for ANY policy at ANY size on this trace.",
            "",
            f"holding every expert this trace touched needs {uniq * expert_bytes / 1e9:.2f} GB.",
            f"holding the whole pool needs {POOL * expert_bytes / 1e9:.2f} GB."]
    return out


def _capacities(text: str) -> list[float]:
    try:
        caps = [float(x) for x in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of GB values: {text!r}") from None
    if not caps or any(c <= 0 for c in caps):
        raise argparse.ArgumentTypeError(f"capacities must be positive GB values: {text!r}")
    return caps


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(
        prog="k3 sim-cache",
        description="Replay an expert_trace.bin (from --dump-cache-trace) at many cache "
                    "capacities: hit rates of LRU, Belady and PIN+LRU, disk read per token.")
    ap.add_argument("trace")
    ap.add_argument("--capacities", type=_capacities, default=list(CAPACITIES_GB),
                    metavar="GB,...", help="cache sizes in GB (default: %(default)s)")
    ap.add_argument("--expert-bytes", type=int, default=EXPERT_BYTES)
    ap.add_argument("--disk-mbs", type=float, default=DISK_MBS,
                    help="random-cold read rate for the SEC/TOK column (default %(default)s)")
    ap.add_argument("--s3fifo", action="store_true", help="add the S3-FIFO column")
    a = ap.parse_args(argv)
    if a.expert_bytes <= 0 or a.disk_mbs <= 0:
        ap.error("--expert-bytes and --disk-mbs must be positive")
    try:
        pairs = read_trace(a.trace)
    except (OSError, TraceError) as e:
        print(f"k3 sim-cache: {e}", file=sys.stderr)
        return 1
    if not len(pairs):
        print(f"k3 sim-cache: {a.trace}: the trace is empty", file=sys.stderr)
        return 1
    for line in report(trace_keys(pairs), a.capacities, a.expert_bytes, a.disk_mbs, a.s3fifo):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
