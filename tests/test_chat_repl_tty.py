"""`k3 --chat` at a terminal (a real pseudo-terminal): the reply text streams as it is
generated, a reply that reaches --gen keeps the REPL open, /continue goes on, /exit ends
with 0.  The non-terminal output is the golden's (test_cli_golden.py, case `chat`)."""
from __future__ import annotations

import json
import os
import pty
import select
import signal
import subprocess
import sys
import time
from contextlib import contextmanager

import pytest


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    from k3engine.tools.make_checkpoint import dims_config, make_checkpoint
    d = tmp_path_factory.mktemp("tty") / "demo"
    make_checkpoint(str(d), dims_config("demo"), seed=9)
    return str(d)


def read_until(fd, needle: bytes, buf: bytearray, timeout: float = 240) -> bytes:
    """Read until `needle` appears in what came since the last call; consume up to it."""
    end = time.monotonic() + timeout
    while needle not in buf:
        if time.monotonic() > end:
            raise AssertionError(f"no {needle!r} in {bytes(buf[-600:])!r}")
        r, _, _ = select.select([fd], [], [], 1)
        if r:
            try:
                buf += os.read(fd, 4096)
            except OSError:
                break
    cut = buf.index(needle) + len(needle)
    got = bytes(buf[:cut])
    del buf[:cut]
    return got


def test_repl_streams_text_and_continues_at_a_terminal(demo):
    master, slave = pty.openpty()
    p = subprocess.Popen([sys.executable, "-m", "k3engine", demo, "--chat", "--tok", demo,
                          "--gen", "3"], stdin=slave, stdout=slave, stderr=slave,
                         close_fds=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    os.close(slave)
    buf = bytearray()
    try:
        read_until(master, b"user> ", buf)
        os.write(master, b"Hello\n")
        out = read_until(master, b"/continue goes on", buf)
        first = out.split(b"Hello", 1)[1]
        assert b"[3 tokens" in first and b"chat: token" not in first, first[-400:]
        assert b"\x1b[2m" in first                  # the thinking streamed, dimmed
        read_until(master, b"user> ", buf)
        os.write(master, b"/continue\n")
        out = read_until(master, b"/continue goes on", buf)
        assert b"[3 tokens" in out, out[-400:]
        read_until(master, b"user> ", buf)
        os.write(master, b"/exit\n")
        assert p.wait(timeout=60) == 0
    finally:
        if p.poll() is None:
            p.kill()
        os.close(master)
    print("[cli] chat at a terminal: streamed, /continue, /exit -> 0")


@contextmanager
def repl(demo, history, *args):
    """`k3 --chat` on a pseudo-terminal: (process, its terminal); killed if still running."""
    p, master = _repl(demo, history, *args)
    try:
        yield p, master
    finally:
        if p.poll() is None:
            p.kill()
        os.close(master)


def _repl(demo, history, *args):
    master, slave = pty.openpty()
    p = subprocess.Popen([sys.executable, "-m", "k3engine", demo, "--chat", "--tok", demo,
                          "--history", str(history), *args], stdin=slave, stdout=slave,
                         stderr=slave, close_fds=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    os.close(slave)
    return p, master


def test_ctrl_c_at_the_prompt_leaves_cleanly_and_help_lists_continue(demo, tmp_path):
    with repl(demo, tmp_path / "h.jsonl", "--gen", "3") as (p, master):
        buf = bytearray()
        read_until(master, b"user> ", buf)
        os.write(master, b"/help\n")
        helped = read_until(master, b"user> ", buf)
        assert b"/continue" in helped
        os.kill(p.pid, signal.SIGINT)                    # Ctrl-C at the prompt
        assert p.wait(timeout=60) == 0
        rest = bytes(buf) + _drain(master)
        assert b"Traceback" not in rest
    print("[cli] chat at a terminal: /help lists /continue, Ctrl-C at the prompt -> 0")


def _drain(fd) -> bytes:
    out = b""
    while True:
        r, _, _ = select.select([fd], [], [], 0.5)
        if not r:
            return out
        try:
            chunk = os.read(fd, 4096)
        except OSError:
            return out
        if not chunk:
            return out
        out += chunk


def test_a_reply_cut_by_kill_9_is_kept_and_continues(demo, tmp_path):
    """kill -9 while a reply streams: the next start says the reply so far is kept, and
    /continue goes on from it."""
    history = tmp_path / "h.jsonl"
    partial = tmp_path / ".h.jsonl.partial.json"
    with repl(demo, history, "--gen", "4000") as (p, master):
        buf = bytearray()
        read_until(master, b"user> ", buf)
        os.write(master, b"Tell me a long story\n")
        end = time.monotonic() + 240
        while not partial.exists() and time.monotonic() < end:
            r, _, _ = select.select([master], [], [], 0.05)
            if r:
                os.read(master, 65536)
        assert partial.exists(), "no partial reply was saved while streaming"
        os.kill(p.pid, signal.SIGKILL)
        p.wait(60)
    kept = json.loads(partial.read_text())
    assert 0 < len(kept["ids"]) < 4000, "killed mid-reply"
    assert os.stat(partial).st_mode & 0o777 == 0o600
    with repl(demo, history, "--gen", "3") as (p, master):
        buf = bytearray()
        said = read_until(master, b"user> ", buf)
        assert b"is kept" in said, said[-400:]
        os.write(master, b"/continue\n")
        out = read_until(master, b"user> ", buf)
        assert b"[3 tokens" in out, out[-400:]
        os.write(master, b"/exit\n")
        assert p.wait(timeout=60) == 0
    print(f"[cli] kill -9 mid-reply: {len(kept['ids'])} ids kept beside the history, "
          f"/continue went on")


def test_ctrl_c_mid_reply_keeps_it_for_continue(demo, tmp_path):
    """Ctrl-C while a reply streams at a terminal: the reply stops at the next safe point,
    stays as an incomplete reply (/continue goes on), and the REPL and its history go on."""
    with repl(demo, tmp_path / "h.jsonl", "--gen", "4000") as (p, master):
        buf = bytearray()
        read_until(master, b"user> ", buf)
        os.write(master, b"Tell me a long story\n")
        read_until(master, b"XTML prompt:", buf)         # the turn started; then its
        read_until(master, b"\x1b[2m", buf)              # thinking streams (dimmed): not a
        os.kill(p.pid, signal.SIGINT)                    # fixed sleep (slow under load)
        said = read_until(master, b"user> ", buf)
        assert b"stopped before its end" in said, said[-400:]
        os.write(master, b"/continue\n")
        time.sleep(0.5)
        os.kill(p.pid, signal.SIGINT)                    # stop the continuation too
        said = read_until(master, b"user> ", buf)
        assert b"Traceback" not in said
        os.write(master, b"/exit\n")
        assert p.wait(timeout=60) == 0
    print("[cli] chat at a terminal: Ctrl-C mid-reply kept it, /continue went on, /exit -> 0")
