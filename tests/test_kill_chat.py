"""kill -9 of `k3 --chat --history` while it streams (issue 47): a bounded, seeded run of
the loop in tests/fuzz/kill_chat.py (the long run: `python -m tests.fuzz.kill_chat --runs
200`).  Every kill leaves a history that reopens, is a prefix of the uninterrupted
transcript and keeps every turn whose end was printed (but the one being saved)."""
from __future__ import annotations

from fuzz.kill_chat import run_kills

RUNS = 12


def test_kill_9_while_streaming_never_damages_the_history(tmp_path):
    out = run_kills(RUNS, seed=47, where=str(tmp_path))
    print(f"[gate] kill -9 of k3 --chat: {out.runs} runs, {out.intact} intact, "
          f"{out.turns_kept} completed turns kept, {out.interrupted} interrupted turns")
    assert out.damaged == [] and out.intact == RUNS
    assert out.interrupted >= 1              # the kills did land inside replies
