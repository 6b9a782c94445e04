"""The built-in demo model: generated on the spot (random weights, our vocabulary) into
the per-user data directory, with its packed trunk, so a first start has something to
run without any download.  Clearly a demo: the output is not language."""
from __future__ import annotations

import os
import shutil

DEMO_DIR, DEMO_TRUNK = "demo-model", "demo-model-trunk"
DEMO_SEED = 0
DEMO_LABEL = "Demo model: random weights, the output is not language"


def data_dir() -> str:
    """Per-user data directory (QStandardPaths AppDataLocation: the app name once, since
    make_app sets no organisation name)."""
    from PySide6.QtCore import QStandardPaths
    root = QStandardPaths.writableLocation(QStandardPaths.AppDataLocation)
    migrate_doubled(root)
    return root


def migrate_doubled(root: str) -> None:
    """Up to 0.1.0 the folder was <data>/K3 Studio/K3 Studio (organisation and application
    both "K3 Studio"): move what is there up one level, never over an existing entry."""
    from . import APP_NAME
    old = os.path.join(root, APP_NAME)
    if os.path.basename(os.path.normpath(root)) != APP_NAME or not os.path.isdir(old):
        return
    for name in os.listdir(old):
        dest = os.path.join(root, name)
        if not os.path.exists(dest):
            os.replace(os.path.join(old, name), dest)
    try:
        os.rmdir(old)
    except OSError:
        pass                     # something was left (a name clash): keep it, lose nothing


def demo_paths(root: str) -> tuple[str, str]:
    return os.path.join(root, DEMO_DIR), os.path.join(root, DEMO_TRUNK)


def is_demo(model_dir: str) -> bool:
    return os.path.basename(os.path.normpath(model_dir or "")) == DEMO_DIR


def demo_ready(root: str) -> bool:
    model, trunk = demo_paths(root)
    return (os.path.isfile(os.path.join(model, "config.json"))
            and os.path.isfile(os.path.join(trunk, "trunk.json")))


def make_demo(root: str, *, progress=None, cancelled=None) -> tuple[str, str]:
    """Write the demo checkpoint and pack its trunk; returns (model_dir, trunk_dir).

    The checkpoint is written to a temporary directory and renamed into place, so an
    interrupted first start never leaves a half-written model that looks usable.
    `progress((phase, done, total))` with phase "model" (bytes) or "trunk" (bytes)."""
    from k3engine.tools.make_checkpoint import dims_config, make_checkpoint
    from k3engine.trunk import pack_trunk

    from .tasks import Aborted
    model, trunk = demo_paths(root)
    os.makedirs(root, exist_ok=True)
    if not os.path.isfile(os.path.join(model, "config.json")):
        tmp = model + ".partial"
        shutil.rmtree(tmp, ignore_errors=True)

        def on_model(done: int, total: int) -> None:
            if cancelled and cancelled():
                raise Aborted("demo creation cancelled")
            if progress:
                progress(("model", done, total))
        try:
            make_checkpoint(tmp, dims_config("demo"), seed=DEMO_SEED, progress=on_model)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        shutil.rmtree(model, ignore_errors=True)
        os.replace(tmp, model)
    if not os.path.isfile(os.path.join(trunk, "trunk.json")):
        pack_trunk(model, trunk, progress=lambda L, done, total: progress and
                   progress(("trunk", done, total)), cancel=cancelled)
    return model, trunk
