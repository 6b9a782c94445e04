"""Our safetensors header parser against the format's reference implementation, the
`safetensors` library (issue 14): what it rejects we reject; where we are stricter the
reason is one of the stated ones.  The Hypothesis family `shard header` (tests/fuzz, run
in tests/test_fuzz.py) does the same on generated inputs; this file covers the hand-made
hostile corpus of test_checkpoint, files the library itself writes, and the checkpoints
our generator writes.

Where the library cannot write our checkpoints: it orders tensors by dtype and then by name
(F32 of every layer, then U16 of every layer, ...), so a layer's trunk tensors are not one
contiguous run (SYSTEM §2.2 packs that run verbatim), and NumPy has no bfloat16 (a uint16
array is written as U16, not BF16).  Our streaming writer (tools/st_writer.py) is still
needed for those two reasons and for shards larger than memory.
"""
from __future__ import annotations

import collections

import numpy as np
import pytest

safetensors = pytest.importorskip("safetensors", reason="safetensors (a core dependency) is "
                                  "not installed")
from safetensors import safe_open  # noqa: E402
from safetensors.numpy import save  # noqa: E402

from fuzz.families import safetensors_verdict, stricter_reason  # noqa: E402
from k3engine.checkpoint import Checkpoint, CheckpointError, parse_header  # noqa: E402
from test_checkpoint import HOSTILE  # noqa: E402  (the hand-made hostile corpus)

# Where we are stricter than the library, and why (each is a documented engine limit).
STRICTER = {
    "dtype outside U8/BF16/F16/F32 (the engine's)",       # the model uses no other dtype
    "rank > 4 (the reference's limit)",                    # SYSTEM §1.4 #8
    "name over 511 bytes (the reference's buffer)",        # SYSTEM §1.4 #16
    "duplicate key (safetensors keeps one silently)",      # SYSTEM §1.4 #15: which one?
    "__metadata__ not an object of strings (null)",        # the library accepts null
    "duplicate key in an entry",
}


def test_hostile_corpus_against_the_library(tmp_path):
    counts: collections.Counter = collections.Counter()
    for case, (blob, _problem, _tensor) in sorted(HOSTILE.items()):
        p = tmp_path / f"{case}.safetensors"
        p.write_bytes(blob)
        with pytest.raises(CheckpointError):
            parse_header(p)                                # every case is hostile to us
        theirs_ok, theirs = safetensors_verdict(str(p))
        if theirs_ok:
            try:
                parse_header(p)
            except CheckpointError as e:
                reason = stricter_reason(str(e))
            counts["stricter: " + reason] += 1
            assert reason in STRICTER, (case, reason)
        else:
            counts["both reject"] += 1
    print(f"[gate] safetensors differential, hostile corpus ({len(HOSTILE)} files): "
          + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    assert counts["both reject"] >= len(HOSTILE) // 2


LIB_DTYPES = {"U8": np.uint8, "F16": np.float16, "F32": np.float32, "U16": np.uint16,
              "I8": np.int8, "F64": np.float64}


@pytest.mark.parametrize("seed", range(40))
def test_files_the_library_writes(tmp_path, seed):
    """Random tensor dicts written by safetensors.numpy.save: we read exactly what it wrote,
    or refuse only a dtype the engine does not use."""
    rng = np.random.default_rng(seed)
    tensors = {}
    for i in range(int(rng.integers(0, 6))):
        dt = list(LIB_DTYPES)[int(rng.integers(0, len(LIB_DTYPES)))]
        shape = tuple(int(d) for d in rng.integers(0, 4, int(rng.integers(0, 4))))
        tensors[f"layers.{i}.w"] = np.asarray(rng.standard_normal(shape) * 10).astype(LIB_DTYPES[dt])
    d = tmp_path / "m"
    d.mkdir()
    p = d / "model.safetensors"
    p.write_bytes(save(tensors, metadata={"format": "np", "seed": str(seed)}))
    theirs_ok, _ = safetensors_verdict(str(p))
    assert theirs_ok
    ours_dtypes = {"U8", "F16", "F32"}
    if any(np.dtype(a.dtype).name not in ("uint8", "float16", "float32") for a in tensors.values()):
        with pytest.raises(CheckpointError, match="unsupported dtype"):
            parse_header(p)
        return
    with Checkpoint(d) as ck:
        assert sorted(ck.names()) == sorted(tensors)
        for name, want in tensors.items():
            info = ck.info(name)
            assert info.dtype in ours_dtypes and info.shape == want.shape
            assert ck.read(name).tobytes() == want.tobytes()


def test_our_generated_checkpoint_reads_the_same_in_the_library(tmp_path):
    from k3engine.tools.make_checkpoint import dims_config, make_checkpoint
    paths = make_checkpoint(str(tmp_path / "tiny"), dims_config("tiny"), seed=3,
                            shard_bytes=1_000_000)
    assert len(paths) > 1
    n = 0
    with Checkpoint(tmp_path / "tiny") as ck:
        for path in paths:
            with safe_open(path, framework="numpy") as f:
                for name in f.keys():
                    sl = f.get_slice(name)
                    info = ck.info(name)
                    assert (sl.get_dtype(), list(sl.get_shape())) == (info.dtype, list(info.shape))
                    if info.dtype != "BF16":               # NumPy cannot hold BF16
                        assert f.get_tensor(name).tobytes() == ck.read(name).tobytes()
                    n += 1
    assert n == len(ck)
    print(f"[gate] safetensors reads our generated tiny checkpoint identically: {n} tensors "
          f"in {len(paths)} shards")
