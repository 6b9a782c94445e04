"""kill -9 of `k3 --chat --history H` at random points while it streams its replies
(issue 47, crash safety of a conversation).

    python -m tests.fuzz.kill_chat --runs 200 [--seed S]     # the long run (a few minutes)

Each run starts the real process on the trained demo model with several user lines on
stdin, waits for a random number of streamed tokens (plus a random few milliseconds, so
kills land in prefill, in a reply, in a save and between turns) and sends SIGKILL.  Then
the history is reopened as a new session would: it must load (never a damaged file), take
the history lock, be a prefix of the uninterrupted run's transcript (greedy decoding makes
that run the same every time) and hold every turn whose end was printed -- except at most
the last one, when the kill fell between printing it and saving it.  A partial reply is
not in the history: `k3 --chat` saves after each user line and each completed turn, so a
killed reply leaves an interrupted turn (§9.4: the history ends with the user message and
the next session answers it again).
"""
from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

LINES = ["Hello there", "Tell me more", "What is a cat?", "Thanks", "Good night", "Hi again"]
GEN = 48


@dataclass
class Outcome:
    runs: int = 0
    intact: int = 0                  # reopened, a prefix of the reference, turns all there
    damaged: list[str] = field(default_factory=list)
    lost_last_turn: int = 0          # killed between printing a turn's end and saving it
    interrupted: int = 0             # the history ended with the user message (§9.4)
    turns_kept: int = 0

    def judge(self, folder: str, ref: list[tuple], turns: int, reopen) -> None:
        """One run's verdict: `reopen()` reads what the kill left as the next start would
        (its messages, role first; raising when it cannot), which must be a prefix of the
        uninterrupted `ref` holding every one of the `turns` reported finished but the
        last.  A failing run's folder is kept for a look."""
        self.runs += 1
        try:
            got = reopen()
            if got != ref[:len(got)]:
                raise AssertionError("not a prefix of the uninterrupted transcript")
            kept = sum(m[0] == "assistant" for m in got)
            if kept < turns - 1:
                raise AssertionError(f"{turns} turns finished, {kept} kept")
            self.lost_last_turn += kept == turns - 1
            self.interrupted += bool(got) and got[-1][0] == "user"
            self.turns_kept += kept
            self.intact += 1
        except Exception as e:  # noqa: BLE001 - counted and reported with the folder
            self.damaged.append(f"{folder}: {type(e).__name__}: {e}")
            return
        shutil.rmtree(folder, ignore_errors=True)


def demo_copy(where: str) -> str:
    """The shipped trained demo model (its turns end), copied so nothing writes into the
    package directory."""
    import importlib.resources
    src = str(importlib.resources.files("k3engine") / "data" / "demo_model")
    dst = os.path.join(where, "demo")
    shutil.copytree(src, dst)
    return dst


def _cmd(model: str, history: str) -> list[str]:
    return [sys.executable, "-m", "k3engine", model, "--chat", "--tok", model, "--gen",
            str(GEN), "--history", history, "--threads", "1"]


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def reference(model: str, where: str) -> tuple[list[tuple], int]:
    """The uninterrupted run's transcript (role, content, reasoning) per message, and the
    tokens it streamed."""
    from k3engine.chat import History
    h = os.path.join(where, "reference.jsonl")
    p = subprocess.run(_cmd(model, h), input="\n".join(LINES) + "\n", text=True,
                       capture_output=True, env=_env(), timeout=600)
    if p.returncode != 0:
        raise RuntimeError(f"the reference run failed ({p.returncode}): {p.stderr[-800:]}")
    msgs = [(m.role, m.content, m.reasoning_content) for m in History.load(h)]
    if sum(r == "assistant" for r, _, _ in msgs) != len(LINES):
        raise RuntimeError(f"the reference run did not complete {len(LINES)} turns")
    return msgs, sum(line.startswith("chat: token ") for line in
                     (p.stdout + p.stderr).splitlines())


def one_run(model: str, ref: list[tuple], n_tokens: int, where: str, rng: random.Random,
            out: Outcome) -> None:
    from k3engine.chat import History, HistoryLock
    d = tempfile.mkdtemp(dir=where)
    h = os.path.join(d, "h.jsonl")
    p = subprocess.Popen(_cmd(model, h), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, env=_env(), text=True, bufsize=1)
    p.stdin.write("\n".join(LINES) + "\n")
    p.stdin.close()                     # end of input: after the last turn it exits
    target = rng.randrange(0, n_tokens + 1)             # tokens to see before the kill
    tokens = turns = 0
    deadline = time.monotonic() + 300
    for line in p.stdout:
        if line.startswith("chat: token "):
            tokens += 1
        elif line.startswith("chat: turn ended"):
            turns += 1
        if tokens >= target or time.monotonic() > deadline:
            break
    time.sleep(rng.random() * 0.02)     # turns ending meanwhile only weaken the check
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=60)
    p.stdout.close()
    def reopen() -> list[tuple]:
        if not os.path.exists(h):
            return []
        got = [(m.role, m.content, m.reasoning_content) for m in History.load(h)]
        with HistoryLock(h):                             # a new session may take it
            History.load(h).save(h)                      # and save (stale temps go)
        leftovers = [n for n in os.listdir(d) if n.startswith(".h.jsonl.tmp-")]
        if leftovers:
            raise AssertionError(f"temp files left after the next save: {leftovers}")
        return got

    out.judge(d, ref, turns, reopen)


def run_kills(runs: int, seed: int, where: str | None = None) -> Outcome:
    own = where is None
    where = where or tempfile.mkdtemp(prefix="k3-kill-")
    try:
        model = demo_copy(where)
        ref, n_tokens = reference(model, where)
        rng = random.Random(seed)
        out = Outcome()
        for _ in range(runs):
            one_run(model, ref, n_tokens, where, rng, out)
        return out
    finally:
        if own:
            shutil.rmtree(where, ignore_errors=True)


def loop_main(argv, prog: str, doc: str, what: str, run_kills, child=None) -> int:
    """The command line of a kill loop (this one and kill_app.py): --runs, --seed, and the
    figures; `child` serves a hidden --child DATA MODEL TRUNK (kill_app's driven app)."""
    ap = argparse.ArgumentParser(prog=prog, description=doc.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--seed", type=int, default=None)
    if child:
        ap.add_argument("--child", nargs=3, metavar=("DATA", "MODEL", "TRUNK"),
                        help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if child and a.child:
        return child(*a.child)
    seed = a.seed if a.seed is not None else random.getrandbits(32)
    t0 = time.monotonic()
    out = run_kills(a.runs, seed)
    print(f"kill -9 of {what} (seed {seed}): {out.runs} runs, {out.intact} reopened intact, "
          f"{len(out.damaged)} damaged, {out.turns_kept} completed turns kept, "
          f"{out.interrupted} interrupted turns (partial replies are not saved), "
          f"{out.lost_last_turn} kills between a turn's end and its save "
          f"({time.monotonic() - t0:.0f} s)")
    for d in out.damaged:
        print(f"  DAMAGED: {d}")
    return 1 if out.damaged else 0


def main(argv=None) -> int:
    return loop_main(argv, "python -m tests.fuzz.kill_chat", __doc__, "k3 --chat", run_kills)


if __name__ == "__main__":
    sys.exit(main())
