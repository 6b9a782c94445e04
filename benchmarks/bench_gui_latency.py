"""GUI responsiveness while K3 Studio generates (a script, not a test): how late does a
16 ms timer on the GUI thread fire while the engine works on its QThread?

    QT_QPA_PLATFORM=offscreen python benchmarks/bench_gui_latency.py MODEL TRUNK [--gen 8]

Drives the real window as a person would (pick the model, load, send a message) and
records the lateness of every tick of a 16 ms QTimer from Send until the turn ends;
prints the max and the 99th percentile with the machine.
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("trunk")
    ap.add_argument("--gen", type=int, default=8)
    ap.add_argument("--trunk-gb", type=float, default=0.5)
    ap.add_argument("--cache-gb", type=float, default=0.5)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    tmp = tempfile.mkdtemp(prefix="k3-gui-latency-")
    os.environ.setdefault("TIKTOKEN_CACHE_DIR", os.path.join(tmp, "tiktoken"))
    from PySide6.QtCore import QSettings, QTimer
    from k3studio.__main__ import make_app
    from k3studio.window import MainWindow
    app = make_app([sys.argv[0]])
    store = QSettings(os.path.join(tmp, "settings.ini"), QSettings.IniFormat)
    for k, v in dict(preset="custom", trunk_gb=a.trunk_gb, cache_gb=a.cache_gb,
                     threads=a.threads, gen=a.gen, effort="low", greedy=True).items():
        store.setValue(k, v)
    store.sync()
    win = MainWindow(store=store, data_dir=os.path.join(tmp, "data"))
    win.show()

    def wait(cond, timeout=1800.0):
        end = time.monotonic() + timeout
        while not cond():
            app.processEvents()
            time.sleep(0.002)
            if time.monotonic() > end:
                raise TimeoutError("the app did not get there in time")

    state = {"loaded": False, "done": False}
    win.host.loaded.connect(lambda *x: state.__setitem__("loaded", True))
    win.host.turnFinished.connect(lambda *x: state.__setitem__("done", True))
    win.setup.set_paths(a.model, a.trunk, a.model)
    wait(lambda: win.setup.inspection is not None and not win.setup.validating
         and win.setup.load_btn.isEnabled())
    win.setup.load_btn.click()
    wait(lambda: state["loaded"] and not win.host.busy)

    late: list[float] = []
    last = [time.monotonic()]
    timer = QTimer()
    timer.setInterval(16)

    def tick():
        now = time.monotonic()
        late.append(max(0.0, (now - last[0]) * 1000 - 16))
        last[0] = now
    timer.timeout.connect(tick)
    win.chat.input.setPlainText("Explain how a mixture-of-experts model picks its experts.")
    wait(lambda: win.chat.send_btn.isEnabled())
    t0 = time.monotonic()
    last[0] = t0
    timer.start()
    win.chat.send_btn.click()
    wait(lambda: state["done"])
    timer.stop()
    dt = time.monotonic() - t0
    late.sort()
    p99 = late[min(len(late) - 1, int(0.99 * len(late)))]
    print(f"machine: {platform.machine()} | cores {os.cpu_count()} | model {a.model} | "
          f"trunk {a.trunk_gb} GB + cache {a.cache_gb} GB, {a.threads} engine threads")
    print(f"turn of {a.gen} tokens in {dt:.1f} s: {len(late)} ticks of a 16 ms GUI timer; "
          f"lateness max {late[-1]:.1f} ms, p99 {p99:.1f} ms, median {late[len(late) // 2]:.1f} ms")
    win.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
