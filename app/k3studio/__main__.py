"""`k3-studio` / `python -m k3studio`: open K3 Studio.

Options (all optional):
  --demo               use the built-in demo model (made on the spot if missing) and load it
  --model DIR          select this checkpoint (with --trunk DIR, --tok DIR)
  --quit-after N       quit by itself after N seconds (also K3STUDIO_QUIT_AFTER=N), for
                       headless checks
  --settings FILE      keep settings in this INI file instead of the per-user store
  --data-dir DIR       keep everything in DIR instead of the per-user data directory: the
                       demo model, conversations, the remote key and (unless --settings
                       says otherwise) the settings, DIR/settings.ini

One instance per data folder: a second start on the same folder raises the first window.
"""
from __future__ import annotations

import argparse
import os
import sys


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="k3-studio", description="K3 Studio: run Kimi K3 "
                                 "exactly on one computer and watch how it does it.")
    ap.add_argument("--demo", action="store_true",
                    help="use the built-in demo model (a tiny trained model, not Kimi K3), "
                         "setting it up if needed")
    ap.add_argument("--model", metavar="DIR", help="checkpoint directory to select")
    ap.add_argument("--trunk", metavar="DIR", default="", help="packed trunk directory")
    ap.add_argument("--tok", metavar="DIR", default="", help="tokenizer directory")
    ap.add_argument("--quit-after", metavar="N", type=float,
                    default=_env_float("K3STUDIO_QUIT_AFTER"),
                    help="quit after N seconds (env K3STUDIO_QUIT_AFTER)")
    ap.add_argument("--settings", metavar="FILE", help="settings INI file")
    ap.add_argument("--data-dir", metavar="DIR", help="keep everything (demo model, "
                    "conversations, settings) in DIR instead of the per-user folders")
    ap.add_argument("--version", action="store_true", help="print the version and exit")
    return ap.parse_args(argv)


def _env_float(name: str) -> float | None:
    v = os.environ.get(name, "").strip()
    try:
        return float(v) if v else None
    except ValueError:
        print(f"k3-studio: ignoring {name}={v!r}: not a number of seconds", file=sys.stderr)
        return None


def make_app(argv: list[str] | None = None):
    """The QApplication with the app's identity, style sheet, icon and fonts."""
    from PySide6.QtGui import QFont
    from PySide6.QtWidgets import QApplication

    from . import APP_NAME, __version__, appres
    app = QApplication.instance() or QApplication(argv or [sys.argv[0]])
    app.setApplicationName(APP_NAME)
    # No organisation name: Qt puts AppDataLocation under <org>/<app>, and with both
    # "K3 Studio" the data folder was ~/.local/share/K3 Studio/K3 Studio (settings name the
    # organisation themselves: settings.default_store).
    app.setOrganizationName("")
    app.setApplicationVersion(__version__)
    app.setDesktopFileName("k3studio")
    app.setWindowIcon(appres.app_icon())
    font = QFont(app.font())
    if font.pointSizeF() < 10:
        font.setPointSizeF(10)
        app.setFont(font)
    app.setStyle("Fusion")
    appres.apply_theme(app, "system")      # the window applies the saved choice
    _quiet_font_warnings()
    # Python's cyclic GC runs in whichever thread happens to allocate; if it frees a Qt
    # widget on the engine or a task thread, Qt deadlocks or crashes.  Collect on a GUI
    # timer instead (pyqtgraph's GarbageCollector disables the automatic collector).
    if not hasattr(app, "_k3studio_gc"):
        from pyqtgraph.util.garbage_collector import GarbageCollector
        app._k3studio_gc = GarbageCollector(interval=1.0)
    _warn_known_bad_toolkit()
    return app


def _quiet_font_warnings() -> None:
    """"OpenType support missing for "DejaVu Sans", script 11" (dozens of lines): Qt logs it
    when text in a script no installed font can shape -- here Devanagari and others in a
    reply -- falls back through fonts without those OpenType tables.  The glyphs show (or
    not) either way; the warning only fills the console.  Installing a font that covers
    the script (e.g. fonts-noto-core) is the real cure; the app silences just this category
    unless the person set QT_LOGGING_RULES themselves."""
    from PySide6.QtCore import QLoggingCategory
    if "QT_LOGGING_RULES" not in os.environ:
        # Qt 6 logs it at info level (enabled by default for this category)
        QLoggingCategory.setFilterRules("qt.text.font.db.info=false\nqt.text.font.db.warning=false")


def _warn_known_bad_toolkit() -> None:
    """PySide6 6.12.0 drops a reference to True on every Signal.emit(); on Python 3.11,
    where True is not immortal, the app then dies with "bool_dealloc" after a while."""
    import PySide6
    if sys.version_info < (3, 12) and PySide6.__version__.startswith("6.12.0"):
        print("k3-studio: WARNING: PySide6 6.12.0 on Python < 3.12 crashes after many "
              "signals (refcount bug); install PySide6-Essentials<6.12", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.version:
        from . import __version__
        print(f"k3-studio {__version__}")
        return 0
    from PySide6.QtCore import QSettings, QTimer

    app = make_app()
    from . import demo
    from .single_instance import InstanceServer, raise_running, raise_window
    from .window import MainWindow
    data_dir = os.path.abspath(args.data_dir) if args.data_dir else demo.data_dir()
    if raise_running(data_dir):
        print(f"k3-studio: already running on {data_dir}: raised its window", file=sys.stderr)
        return 0
    settings_file = args.settings or (os.path.join(data_dir, "settings.ini")
                                      if args.data_dir else None)
    if settings_file:
        os.makedirs(os.path.dirname(os.path.abspath(settings_file)), exist_ok=True)
    # --data-dir: its own settings too (the model remembered elsewhere is not loaded)
    store = QSettings(settings_file, QSettings.IniFormat) if settings_file else None
    win = MainWindow(store=store, data_dir=data_dir)
    instance = InstanceServer(data_dir, win)
    instance.raiseRequested.connect(lambda: raise_window(win))
    if args.model:
        win.setup.set_paths(os.path.abspath(args.model),
                            os.path.abspath(args.trunk) if args.trunk else "",
                            os.path.abspath(args.tok) if args.tok else "")
    elif args.demo:
        win.use_demo(autoload=True)
    win.show()
    if args.quit_after is not None:
        QTimer.singleShot(int(args.quit_after * 1000), win.close)
    code = app.exec()
    dispose(win)
    return int(code)


def dispose(win) -> None:
    """Destroy the window while Python is still alive.  Left to interpreter exit, the
    QApplication's teardown sends palette/style change events to pyqtgraph's items, whose
    Python overrides then run during finalisation and crash shiboken (seen under X11)."""
    from PySide6.QtCore import QCoreApplication, QEvent
    win.deleteLater()
    QCoreApplication.sendPostedEvents(None, QEvent.DeferredDelete)


if __name__ == "__main__":
    sys.exit(main())
