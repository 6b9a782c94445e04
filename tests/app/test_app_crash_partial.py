"""kill -9 of K3 Studio while a reply streams keeps the reply so far (issue 47): the
conversation reopens with it as an incomplete reply, which Continue resumes."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

from .app_helpers import TIMEOUT

CHILD = textwrap.dedent("""
    import os, sys, time
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    from PySide6.QtCore import QSettings
    from PySide6.QtWidgets import QApplication
    from k3studio.window import MainWindow
    data, model = sys.argv[1], sys.argv[2]
    app = QApplication([])
    store = QSettings(os.path.join(data, "settings.ini"), QSettings.IniFormat)
    for k, v in dict(threads=1, gen=400, greedy=True).items():
        store.setValue(k, v)
    win = MainWindow(store=store, data_dir=data)
    win.show()
    win.setup.set_paths(model, "", "")
    def wait(cond):
        while not cond():
            app.processEvents()
            time.sleep(0.01)
    wait(lambda: win.setup.inspection is not None and not win.setup.validating
         and win.setup.load_btn.isEnabled())
    win.setup.load_btn.click()
    wait(lambda: win.host.model_loaded and not win.host.busy)
    win.chat.input.setPlainText("Tell me a long story")
    wait(lambda: win.chat.send_btn.isEnabled())
    win.chat.send_btn.click()
    print("sent", flush=True)
    wait(lambda: False)
""")


def test_a_reply_streaming_when_the_app_is_killed_is_kept(qtbot, store, tmp_path):
    from k3engine.tools.make_checkpoint import dims_config, make_checkpoint
    from k3studio.conversations import ConversationStore, default_root
    model = str(tmp_path / "demo")
    make_checkpoint(model, dims_config("demo"), seed=9)   # random weights: never closes
    data = str(tmp_path / "data")
    os.makedirs(data)
    p = subprocess.Popen([sys.executable, "-c", CHILD, data, model], stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1",
                              "K3STUDIO_KEY_STORE": "file"})
    try:
        assert p.stdout.readline().strip() == "sent"
        folder = default_root(data)
        end = time.monotonic() + TIMEOUT / 1000
        partial = None
        while partial is None and time.monotonic() < end:   # the first tokens are saved
            for name in os.listdir(folder) if os.path.isdir(folder) else ():
                if name.endswith(".meta.json"):
                    with open(os.path.join(folder, name)) as f:
                        meta = json.load(f)
                    if (meta.get("incomplete") or {}).get("ids"):
                        partial = meta["incomplete"]
            time.sleep(0.05)
        assert partial is not None, "no partial reply was saved while streaming"
        assert p.poll() is None, "the reply ended before the kill"
        p.send_signal(signal.SIGKILL)
        p.wait(60)
    finally:
        if p.poll() is None:
            p.kill()
    conv = ConversationStore(folder)
    (cid,) = [m.id for m in conv.list()]
    history, meta = conv.load(cid)
    print(f"[app] killed mid-reply: {len(meta.incomplete['ids'])} ids of the reply kept "
          f"({len(meta.incomplete['content'])} characters), transcript ends with "
          f"{history[-1].role}")
    assert history[-1].role == "user" and meta.incomplete["ids"]
    assert all(isinstance(i, int) and i >= 0 for i in meta.incomplete["ids"])
