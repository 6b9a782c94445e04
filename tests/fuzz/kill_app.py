"""kill -9 of K3 Studio at random points while it streams replies (issue 47).

    python -m tests.fuzz.kill_app --runs 200 [--seed S]     # the long run

Each run starts the real window in a child process (offscreen) on the trained demo model,
loads it and sends user messages one after another as a person would (the Send button);
the parent kills it with SIGKILL at a random time between the model's load and the end of
the uninterrupted run's last turn.  Then the conversations folder is
reopened as the next start would: every conversation loads (none is moved aside as
damaged), its transcript is a prefix of the uninterrupted run's (greedy decoding) and it
holds every turn the child reported finished -- except at most the last one, when the
kill fell between the turn's end and its save.  The partial reply of a killed turn is kept
beside the transcript as an incomplete reply (conversation_library.py saves it as its first
tokens come and then about once a second; tests/app/test_app_crash_partial.py).
"""
from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from .kill_chat import Outcome, loop_main

LINES = ["Hello there", "Tell me more", "What is a cat?", "Thanks"]
STEP = 0.01


def child(data: str, model: str, trunk: str) -> int:
    """The app, driven through its widgets; prints `loaded` and `turn N` as they happen."""
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    from PySide6.QtCore import QSettings
    from PySide6.QtWidgets import QApplication

    from k3studio.window import MainWindow
    app = QApplication.instance() or QApplication([])
    store = QSettings(os.path.join(data, "settings.ini"), QSettings.IniFormat)
    for k, v in dict(preset="custom", trunk_gb=0.05, cache_gb=0.05, threads=1, gen=48,
                     greedy=True).items():
        store.setValue(k, v)
    win = MainWindow(store=store, data_dir=data)
    win.show()
    done = {"loaded": False, "turns": 0}
    win.host.loaded.connect(lambda *_: done.__setitem__("loaded", True))
    win.host.turnFinished.connect(lambda *_: done.__setitem__("turns", done["turns"] + 1))

    def wait(cond, seconds: float = 120.0) -> None:
        end = time.monotonic() + seconds
        while not cond():
            if time.monotonic() > end:
                raise SystemExit("timed out")
            app.processEvents()
            time.sleep(STEP)

    win.setup.set_paths(model, trunk, "")
    wait(lambda: win.setup.inspection is not None and not win.setup.validating
         and win.setup.load_btn.isEnabled())
    win.setup.load_btn.click()
    wait(lambda: done["loaded"] and not win.host.busy)
    print("loaded", flush=True)
    for i, text in enumerate(LINES, 1):
        win.chat.input.setPlainText(text)
        wait(lambda: win.chat.send_btn.isEnabled())
        win.chat.send_btn.click()
        wait(lambda: done["turns"] >= i)
        print(f"turn {i}", flush=True)
    wait(lambda: not win.host.busy)
    app.processEvents()
    sys.stdout.flush()
    os._exit(0)         # no teardown: the engine thread would abort Qt at exit (not our test)


def _spawn(data: str, model: str, trunk: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "fuzz.kill_app", "--child", data, model,
                             trunk], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True, env={**os.environ, "OMP_NUM_THREADS": "1",
                                            "QT_QPA_PLATFORM": "offscreen",
                                            "K3STUDIO_KEY_STORE": "file"},
                            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _transcripts(data: str) -> list[list[tuple]]:
    """Every conversation of the folder as the next start reads it."""
    from k3studio import damaged
    from k3studio.conversations import ConversationStore, default_root
    damaged.take_notices()               # notices of earlier tests in this process are theirs
    store = ConversationStore(default_root(data))
    out = [[(m.role, m.content) for m in store.load(m.id)[0]] for m in store.list()]
    notes = damaged.take_notices()
    if notes:
        raise AssertionError(f"moved aside as damaged: {notes}")
    return out


def reference(model: str, trunk: str, where: str) -> tuple[list[tuple], float]:
    data = tempfile.mkdtemp(dir=where)
    p = _spawn(data, model, trunk)
    first = p.stdout.readline()
    t0 = time.monotonic()
    out, _ = p.communicate(timeout=600)
    out = first + out
    took = time.monotonic() - t0                # from the model loaded to the last turn
    got = _transcripts(data)
    if p.returncode != 0 or len(got) != 1 or f"turn {len(LINES)}" not in out:
        raise RuntimeError(f"the reference run failed ({p.returncode}): {out[-400:]}")
    return got[0], took


def one_run(model: str, trunk: str, ref: list[tuple], took: float, where: str,
            rng: random.Random, out: Outcome) -> None:
    data = tempfile.mkdtemp(dir=where)
    p = _spawn(data, model, trunk)
    first = p.stdout.readline()                 # "loaded": the kill lands among the turns
    time.sleep(rng.random() * took)
    p.send_signal(signal.SIGKILL)
    printed, _ = p.communicate(timeout=60)
    printed = first + printed
    turns = printed.count("turn ")
    def reopen() -> list[tuple]:
        got = _transcripts(data)
        if len(got) > 1:
            raise AssertionError(f"{len(got)} conversations for one")
        return got[0] if got else []

    out.judge(data, ref, turns, reopen)


def run_kills(runs: int, seed: int, where: str | None = None) -> Outcome:
    from k3engine.tools.demo import ready_dir
    own = where is None
    where = where or tempfile.mkdtemp(prefix="k3-killapp-")
    try:
        model = ready_dir(cache=os.path.join(where, "cache"), in_place=False)
        trunk = os.path.join(model, "trunk")
        ref, took = reference(model, trunk, where)
        rng = random.Random(seed)
        out = Outcome()
        for _ in range(runs):
            one_run(model, trunk, ref, took, where, rng, out)
        return out
    finally:
        if own:
            shutil.rmtree(where, ignore_errors=True)


def main(argv=None) -> int:
    return loop_main(argv, "python -m tests.fuzz.kill_app", __doc__, "K3 Studio", run_kills,
                     child=child)


if __name__ == "__main__":
    sys.exit(main())
