"""`k3 pack-trunk <model_dir> <trunk_dir> [--layers N] [--draft-bits B]`: copy every layer's
trunk run into trunk.bin + trunk.json (SYSTEM §2.2), once, so the trunk can stream layer by
layer.

With --draft-bits B it packs a draft trunk for hybrid decode (--draft-trunk) instead: every
BF16 matrix but the router quantised per row to B-bit integers (the int8-derived draft of
the reference at B = 8), stored as int8 rows + a float32 scale per row (dtype I8R, about
half the bytes) or, with --draft-format bf16, dequantised back to BF16 in the exact
trunk's layout.  The exact model refuses a draft trunk as --trunk.

With --compress it also writes a lossless compressed copy beside the plain trunk:
trunk.k3z + trunk.k3z.json (docs/trunk-compress.md).  Every large BF16 tensor's exponent
byte is Huffman-coded and its sign + mantissa byte kept raw, in independent blocks;
trunk.bin and trunk.json stay byte for byte as without it (the reference reads those).
A streamed run (--trunk DIR) then reads trunk.k3z instead of trunk.bin, decoding on the
trunk's reader threads, only when decoding outruns the device on the machine: it
measures both at open and says which it chose ("trunk reads: ..."); K3_TRUNK_COMPRESS=
on|off|auto overrides the choice.  Same bits either way: each block is checked as it is
decoded, and a damaged compressed file falls back to trunk.bin with a warning."""
from __future__ import annotations

import argparse
import sys
import time

from ..checkpoint import CheckpointError
from ..config import ConfigError


EPILOG = ("--compress: trunk.bin stays as it is; trunk.k3z is read in its place only when "
          "decoding outruns the device (measured when a run opens the trunk; "
          "K3_TRUNK_COMPRESS=on|off|auto overrides). Exit codes: 0 packed, 1 a damaged or "
          "unwritable file (named), 2 usage.")


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="k3 pack-trunk", description=__doc__.split("\n\n")[0],
                                 epilog=EPILOG)
    ap.add_argument("model_dir")
    ap.add_argument("trunk_dir")
    ap.add_argument("--layers", type=int, default=None, help="layers to pack (default: all)")
    ap.add_argument("--draft-bits", type=int, default=None, metavar="B",
                    help="pack a quantised draft trunk, B-bit per row (2..8; 8 recommended)")
    ap.add_argument("--draft-format", choices=("i8r", "bf16"), default="i8r",
                    help="draft storage: int8 rows + scales (default) or dequantised BF16")
    ap.add_argument("--compress", action="store_true",
                    help="also write the lossless compressed trunk (trunk.k3z + "
                         "trunk.k3z.json) that streamed runs read when decoding outruns the "
                         "device; trunk.bin is unchanged")
    ap.add_argument("--compress-block-kb", type=int, default=None, metavar="K",
                    help="raw KiB per independently decoded block (default 2048)")
    a = ap.parse_args(argv)
    if a.compress_block_kb is not None and (not a.compress or a.compress_block_kb < 1):
        ap.error("--compress-block-kb needs --compress and a positive size")
    if a.draft_bits is not None and not 2 <= a.draft_bits <= 8:
        ap.error(f"--draft-bits {a.draft_bits} is out of range (2..8)")
    from ..trunk import pack_trunk
    t0 = time.monotonic()
    last = [-1]

    def progress(layers_done: int, done: int, total: int) -> None:
        if layers_done != last[0] and layers_done % 10 == 0 and layers_done:
            last[0] = layers_done
            dt = time.monotonic() - t0
            print(f"packed {layers_done} layers, {done / 1e9:.2f} GB, {dt:.0f} s "
                  f"({done / 1e6 / max(dt, 1e-9):.0f} MB/s)", flush=True)
    try:
        m = pack_trunk(a.model_dir, a.trunk_dir, a.layers, progress, draft_bits=a.draft_bits,
                       draft_format=a.draft_format)
    except (CheckpointError, ConfigError) as e:
        print(f"k3 pack-trunk: {e}", file=sys.stderr)
        return 1
    except OSError as e:        # read-only or full target: the old trunk is untouched
        where = e.filename or a.trunk_dir
        print(f"k3 pack-trunk: cannot write {where}: {e.strerror or e} (any trunk already "
              f"in {a.trunk_dir} is unchanged)", file=sys.stderr)
        return 1
    for note in m.notes:
        print(f"k3 pack-trunk: {note}")
    if a.compress:
        from ..trunk import compress_trunk
        from ..trunk_compress import BLOCK_BYTES, K3zError
        block = a.compress_block_kb * 1024 if a.compress_block_kb else BLOCK_BYTES
        t1 = time.monotonic()
        try:
            ct = compress_trunk(a.trunk_dir, block)
        except (CheckpointError, K3zError) as e:
            print(f"k3 pack-trunk: {e}", file=sys.stderr)
            return 1
        except OSError as e:
            print(f"k3 pack-trunk: cannot write {e.filename or a.trunk_dir}: "
                  f"{e.strerror or e} (trunk.bin and trunk.json are complete)", file=sys.stderr)
            return 1
        for note in ct.notes:
            print(f"k3 pack-trunk: {note}")
        print(f"wrote trunk.k3z: {ct.stored_bytes / 1e9:.2f} GB for {ct.raw_bytes / 1e9:.2f} "
              f"GB of layer bytes ({100 * (1 - ct.stored_bytes / max(ct.raw_bytes, 1)):.1f} % "
              f"fewer) in {time.monotonic() - t1:.1f} s")
    kind = f" (draft, {a.draft_bits}-bit per row, {a.draft_format})" if a.draft_bits else ""
    print(f"wrote trunk.bin{kind}: {m.total_bytes() / 1e9:.2f} GB across {len(m.layers)} "
          f"layers in {time.monotonic() - t0:.1f} s")
    print(f"largest layer run: {max(x.nbytes for x in m.layers) / 1e9:.3f} GB  <- the "
          f"streaming slot size")
    print("per-layer SHA-256 digests recorded in trunk.json (check with k3 doctor --verify "
          f"--trunk {a.trunk_dir})")
    return 0
