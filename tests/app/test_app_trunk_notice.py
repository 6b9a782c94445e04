"""The streamed trunk's notices reach the person: which trunk file is read, and a damaged
compressed trunk (plain reads instead, same ids) said in the status line, not only on a
terminal nobody sees."""
from __future__ import annotations

import os
import shutil

from k3engine.kernels import _k3z as Z
from k3engine.trunk import compress_trunk
from k3engine.trunk_compress import K3Z_BIN, MODE_ENV, CompressedTrunk
from k3engine.trunk import TrunkManifest

from .app_helpers import load, send


def test_a_damaged_compressed_trunk_is_reported_in_the_status_line(qtbot, window, demo_model,
                                                                    tmp_path, monkeypatch):
    model, trunk = demo_model
    d = str(tmp_path / "trunk")
    shutil.copytree(trunk, d)
    compress_trunk(d, block_bytes=64 << 10)
    ct = CompressedTrunk.load(d, TrunkManifest.load(d))
    L = len(ct.layers) - 1
    b = next(b for b in ct.layers[L].blocks if b.codec == Z.CODEC_HX8)       # a coded block
    with open(os.path.join(d, K3Z_BIN), "r+b") as f:
        f.seek(b.file_off + b.stored_nbytes - 3)
        x = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([x[0] ^ 0x10]))
    monkeypatch.setenv(MODE_ENV, "on")                 # read the compressed file on any disk
    said: list[str] = []
    window.host.status.connect(said.append)
    window.memory.trunk.spin.setValue(0.0)             # nothing pinned: every layer streams
    load(qtbot, window, model, d)
    send(qtbot, window, "Hello")
    warnings = [s for s in said if s.startswith("warning: ")]
    print(f"[gate] app status lines about the trunk: {[s for s in said if 'trunk' in s]}")
    assert any("trunk.k3z" in s for s in said if not s.startswith("warning: "))  # the choice
    assert len(warnings) == 1 and K3Z_BIN in warnings[0] and f"layer {L}" in warnings[0]
