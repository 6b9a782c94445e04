"""What one streamed bind costs (a script, not a test): Binder.layer over a packed trunk's
layer run already in memory, per layer kind, medians of repeated binds.

    python benchmarks/bench_bind.py MODEL_DIR TRUNK_DIR [--binds 200]

The run's bytes are not read (the buffer is blank): only the bookkeeping a ring slot's
bind repeats on every pass (name lists, element-count checks, views, small vectors widened)
is timed, wall and process CPU.
"""
from __future__ import annotations

import argparse
import os
import time

from k3engine.config import load_config
from k3engine.diskio import AlignedBuffer
from k3engine.loading import open_model
from k3engine.trunk import TrunkLayerSource


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("trunk")
    ap.add_argument("--binds", type=int, default=200)
    a = ap.parse_args()
    cfg = load_config(os.path.join(a.model, "config.json"))
    setup = open_model(a.model, cfg, None, a.trunk)
    m, binder = setup.manifest, setup.binder
    kinds = {}
    for L in range(cfg.n_layers):                 # the first layer of each kind
        kinds.setdefault(("KDA" if cfg.is_kda(L) else "MLA") +
                         (" dense" if cfg.is_dense(L) else " MoE"), L)
    for name, L in kinds.items():
        buf = AlignedBuffer(m.layers[L].nbytes)
        binder.layer(L, TrunkLayerSource(m, L, buf.view))
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(a.binds):
            binder.layer(L, TrunkLayerSource(m, L, buf.view))
        n = a.binds
        print(f"layer {L} ({name}): {(time.perf_counter() - t0) / n * 1e6:.0f} us wall, "
              f"{(time.process_time() - c0) / n * 1e6:.0f} us CPU per bind ({n} binds)")
        buf.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
