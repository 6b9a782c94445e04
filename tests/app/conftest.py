"""App tests: pytest-qt, offscreen, on the demo model generated into a temp directory.

Qt must see QT_QPA_PLATFORM before it is imported, and tiktoken must never look for a
network cache: both are set here, before anything imports them."""
from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
os.environ.setdefault("TIKTOKEN_CACHE_DIR", tempfile.mkdtemp(prefix="k3studio-tiktoken-"))
os.environ.pop("K3_FAIL_EXPERT", None)

import pytest  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def _make_importable() -> None:
    """Until the project is installed with the app mapped (pyproject), find `k3studio` in
    app/ and `k3studio_resources` in resources/ -- the same mapping the install makes."""
    if importlib.util.find_spec("k3studio") is None:
        sys.path.insert(0, str(REPO / "app"))
    # this checkout's resources, even when another checkout's are installed in the venv
    # (its style sheet would be the one under test)
    found = importlib.util.find_spec("k3studio_resources")
    if found is None or not str(found.origin or "").startswith(str(REPO / "resources")):
        spec = importlib.util.spec_from_file_location(
            "k3studio_resources", REPO / "resources" / "__init__.py",
            submodule_search_locations=[str(REPO / "resources")])
        mod = importlib.util.module_from_spec(spec)
        sys.modules["k3studio_resources"] = mod
        spec.loader.exec_module(mod)


_make_importable()
pytest.importorskip("PySide6", reason="the app tests need PySide6 (the [app] extra)")
pytest.importorskip("pyqtgraph", reason="the app tests need pyqtgraph (the [app] extra)")
pytest.importorskip("pytestqt", reason="the app tests need pytest-qt (the [test] extra)")

from PySide6.QtCore import QSettings  # noqa: E402

from .app_helpers import TIMEOUT  # noqa: E402,F401


@pytest.fixture(autouse=True)
def gc_on_the_gui_thread(qapp):
    """Collect cyclic garbage only here, on the GUI thread: a collection that happens to
    run on a worker thread may free a previous test's widgets there (Qt deadlocks).  The
    app does the same with a GUI timer (k3studio.__main__.make_app)."""
    import gc

    from PySide6.QtCore import QCoreApplication, QEvent
    was = gc.isenabled()
    gc.disable()
    yield
    QCoreApplication.sendPostedEvents(None, QEvent.DeferredDelete)
    QCoreApplication.processEvents()
    gc.collect()
    if was:
        gc.enable()


@pytest.fixture(scope="session")
def demo_model(tmp_path_factory):
    """(model_dir, trunk_dir): the demo checkpoint (seed 1) and its packed trunk."""
    from k3engine.tools.make_checkpoint import dims_config, make_checkpoint
    from k3engine.trunk import pack_trunk
    root = tmp_path_factory.mktemp("demo")
    model, trunk = root / "demo-model", root / "demo-model-trunk"
    make_checkpoint(str(model), dims_config("demo"), seed=1)
    pack_trunk(str(model), str(trunk))
    return str(model), str(trunk)


@pytest.fixture
def model_copy(demo_model, tmp_path):
    """A private copy of the demo checkpoint that a test may damage."""
    d = tmp_path / "model"
    shutil.copytree(demo_model[0], d)
    return str(d)


@pytest.fixture
def store(tmp_path):
    """A settings store in a temp INI file, preset for fast, deterministic runs: one
    compute thread, small budgets (some layers pinned, a ring, an expert cache that
    evicts), a short generation limit."""
    s = QSettings(str(tmp_path / "settings.ini"), QSettings.IniFormat)
    for k, v in dict(preset="custom", trunk_gb=0.005, cache_gb=0.005, threads=1, gen=12,
                     effort="low", greedy=True).items():
        s.setValue(k, v)
    s.sync()
    return s


@pytest.fixture
def window(qtbot, store, tmp_path):
    from k3studio.window import MainWindow
    win = MainWindow(store=store, data_dir=str(tmp_path / "data"))
    qtbot.addWidget(win)
    win.show()
    yield win
    win.close()
