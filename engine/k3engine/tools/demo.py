"""`k3 demo --path`: the directory of the trained demo model, ready to run.

The demo model (a tiny model in the Kimi K3 architecture, trained by `k3 train-demo` on the
project's own corpus; docs/demo-model.md) ships as package data in `k3engine/data/demo_model/`
without a packed trunk.  On first use its trunk is packed (`k3engine.trunk.pack_trunk`) into
`<dir>/trunk`: in the package directory itself when it is writable (a checkout), otherwise
in a copy under the per-user cache directory (`$XDG_CACHE_HOME/k3studio`, default
`~/.cache/k3studio`), named by the shipped manifest's hash so a newer model gets a new copy.
Both steps are atomic (temp directory, then rename): a crash never leaves a directory that
looks ready, and two processes racing both end with the same complete copy.

    k3 demo --path          # prints the model directory
    k3 demo --trunk-path    # prints its packed trunk (<dir>/trunk)
    k3 demo --drafter-path  # prints its block drafter's folder (k3engine/data/demo_drafter)
    k3 <that dir> --trunk <that dir>/trunk --chat --tok <that dir>
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.resources
import os
import shutil
import sys

MANIFEST = "MANIFEST.sha256"
TRUNK = "trunk"


def shipped_dir() -> str:
    """The package-data directory (a real directory: k3engine is an on-disk package)."""
    return str(importlib.resources.files("k3engine") / "data" / "demo_model")


def drafter_dir() -> str:
    """The demo model's block drafter (`k3 train-demo-drafter`), package data beside it:
    a folder in the contract's format, ready for `--draft-model`.  It needs no packing."""
    return str(importlib.resources.files("k3engine") / "data" / "demo_drafter")


def cache_root() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "k3studio")


def manifest_files(model_dir: str) -> list[str]:
    """The file names the manifest lists (refuses a directory without one)."""
    path = os.path.join(model_dir, MANIFEST)
    try:
        with open(path, encoding="utf-8") as f:
            lines = [ln.rstrip("\n") for ln in f if ln.strip()]
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: the demo model's manifest is missing") from None
    names = []
    for n, ln in enumerate(lines, 1):
        digest, sep, name = ln.partition("  ")
        if not sep or len(digest) != 64 or not name or "/" in name:
            raise ValueError(f"{path}:{n}: not a 'sha256  name' line")
        names.append(name)
    return names


def _read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return None


def is_ready(model_dir: str) -> bool:
    """A complete trunk packed from the weights the manifest names now.  Trap: a trunk packed
    in place before the shipped weights were retrained would otherwise pass (trunk.json
    exists) and the engine would run the old trunk with the new experts; pack time copies
    the manifest into the trunk directory and a mismatch means repack
    (tests/test_demo_model.py::test_a_trunk_of_older_weights_is_repacked)."""
    stamp = _read(os.path.join(model_dir, TRUNK, MANIFEST))
    return (os.path.isfile(os.path.join(model_dir, TRUNK, "trunk.json")) and stamp is not None
            and stamp == _read(os.path.join(model_dir, MANIFEST)))


def _writable(d: str) -> bool:
    return os.access(d, os.W_OK | os.X_OK)


def _pack_into(model_dir: str) -> None:
    from ..trunk import pack_trunk
    final = os.path.join(model_dir, TRUNK)
    if os.path.exists(final) and not is_ready(model_dir):
        shutil.rmtree(final, ignore_errors=True)       # left by a crash before the rename
    tmp = f"{final}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        pack_trunk(model_dir, tmp)
        shutil.copyfile(os.path.join(model_dir, MANIFEST), os.path.join(tmp, MANIFEST))
        try:
            os.replace(tmp, final)
        except OSError:
            if not is_ready(model_dir):                # lost a race to a complete trunk: fine
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def ready_dir(src: str | None = None, cache: str | None = None,
              in_place: bool | None = None) -> str:
    """The directory of a ready-to-run demo model (its trunk packed), making it if needed.
    `in_place` None packs in `src` when it is writable; False always uses the cache copy."""
    src = src or shipped_dir()
    names = manifest_files(src)
    if in_place is None:
        in_place = _writable(src)
    if in_place and is_ready(src):
        return src
    if in_place:
        _pack_into(src)
        return src
    with open(os.path.join(src, MANIFEST), "rb") as f:
        tag = hashlib.sha256(f.read()).hexdigest()[:12]
    root = cache or cache_root()
    final = os.path.join(root, f"demo-model-{tag}")
    if is_ready(final):
        return final
    os.makedirs(root, exist_ok=True)
    tmp = f"{final}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        os.makedirs(tmp)
        for name in names + [MANIFEST]:
            shutil.copyfile(os.path.join(src, name), os.path.join(tmp, name))
        _pack_into(tmp)
        if os.path.exists(final) and not is_ready(final):
            shutil.rmtree(final, ignore_errors=True)      # a stale half copy: not ours to keep
        try:
            os.replace(tmp, final)
        except OSError:
            if not is_ready(final):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="k3 demo",
                                 description="The trained demo model (a tiny model in the Kimi "
                                             "K3 architecture, not Kimi K3).")
    what = ap.add_mutually_exclusive_group(required=True)
    what.add_argument("--path", action="store_true",
                      help="print the model directory (packing its trunk on first use)")
    what.add_argument("--trunk-path", action="store_true", help="print its packed trunk")
    what.add_argument("--drafter-path", action="store_true",
                      help="print the folder of its block drafter (for --draft-model)")
    ap.add_argument("--cache-dir", help="where a copy goes when the package is read-only "
                                        "(default $XDG_CACHE_HOME/k3studio)")
    a = ap.parse_args(argv)
    if a.drafter_path:
        d = drafter_dir()
        if not os.path.isfile(os.path.join(d, MANIFEST)):
            print(f"k3 demo: {d}: the demo drafter is not there (its {MANIFEST} is missing)",
                  file=sys.stderr)
            return 1
        print(d)
        return 0
    try:
        d = ready_dir(cache=a.cache_dir)
    except (OSError, ValueError) as e:
        print(f"k3 demo: {e}", file=sys.stderr)
        return 1
    print(os.path.join(d, TRUNK) if a.trunk_path else d)
    return 0
