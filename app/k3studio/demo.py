"""The built-in demo model: the trained demo (`k3 demo --path`, docs/demo-model.md), a tiny
model in the Kimi K3 architecture trained on a small corpus the project wrote, copied from the
package into the per-user data directory with its packed trunk, so a first start has
something to run without any download.  Clearly a demo: it is not Kimi K3.
`k3 make-checkpoint --dims demo` still makes random models of the older demo shape."""
from __future__ import annotations

import os
import shutil

DEMO_DIR, DEMO_TRUNK = "demo-model", "demo-model-trunk"
DEMO_LABEL = "Demo model: a tiny model trained on a small corpus, not Kimi K3"
# the welcome card's line: what the demo knows, so an off-corpus answer is no surprise
DEMO_BLURB = ("A tiny model trained only on small sums, days and months, unit conversions "
              "and facts about K3 Studio: it shows the engine at work, not Kimi K3's answers. "
              "Other questions get confident nonsense.")


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


def _shipped() -> str:
    from k3engine.tools.demo import shipped_dir
    return shipped_dir()


def _manifest(model_dir: str) -> bytes | None:
    from k3engine.tools.demo import MANIFEST
    try:
        with open(os.path.join(model_dir, MANIFEST), "rb") as f:
            return f.read()
    except OSError:
        return None


def demo_ready(root: str) -> bool:
    """Both parts present and the copy is of the model this package ships (an older copy,
    e.g. the random-weights demo of earlier versions, is replaced)."""
    model, trunk = demo_paths(root)
    return (os.path.isfile(os.path.join(model, "config.json"))
            and os.path.isfile(os.path.join(trunk, "trunk.json"))
            and _manifest(model) == _manifest(_shipped()))


def make_demo(root: str, *, progress=None, cancelled=None) -> tuple[str, str]:
    """Copy the trained demo model and pack its trunk; returns (model_dir, trunk_dir).

    The copy goes to a temporary directory renamed into place, so an interrupted first
    start never leaves a half-written model that looks usable.  `progress((phase, done,
    total))` with phase "model" (bytes copied) or "trunk" (bytes packed)."""
    from k3engine.tools.demo import manifest_files, MANIFEST
    from k3engine.trunk import pack_trunk

    from .tasks import Aborted
    model, trunk = demo_paths(root)
    src = _shipped()
    os.makedirs(root, exist_ok=True)
    if demo_ready(root):
        return model, trunk
    if _manifest(model) != _manifest(src) or not os.path.isfile(os.path.join(model, "config.json")):
        names = manifest_files(src) + [MANIFEST]
        total = sum(os.path.getsize(os.path.join(src, n)) for n in names)
        tmp = model + ".partial"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            os.makedirs(tmp)
            done = 0
            for n in names:
                if cancelled and cancelled():
                    raise Aborted("demo creation cancelled")
                shutil.copyfile(os.path.join(src, n), os.path.join(tmp, n))
                done += os.path.getsize(os.path.join(src, n))
                if progress:
                    progress(("model", done, total))
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        shutil.rmtree(model, ignore_errors=True)
        shutil.rmtree(trunk, ignore_errors=True)       # packed from the old model
        os.replace(tmp, model)
    if not os.path.isfile(os.path.join(trunk, "trunk.json")):
        pack_trunk(model, trunk, progress=lambda L, done, total: progress and
                   progress(("trunk", done, total)), cancel=cancelled)
    return model, trunk
