"""kill -9 while a reply streams (issue 47): bounded, seeded runs of the loops in
tests/fuzz/kill_chat.py (`k3 --chat --history`) and tests/fuzz/kill_app.py (K3 Studio); the
long runs are `python -m tests.fuzz.kill_chat --runs 200` and `... kill_app --runs 200`.
Every kill leaves files that reopen, a prefix of the uninterrupted transcript, with every
turn whose end was reported (but the one being saved)."""
from __future__ import annotations

from fuzz.kill_chat import run_kills

RUNS = 12


def test_kill_9_while_streaming_never_damages_the_history(tmp_path):
    out = run_kills(RUNS, seed=47, where=str(tmp_path))
    print(f"[gate] kill -9 of k3 --chat: {out.runs} runs, {out.intact} intact, "
          f"{out.turns_kept} completed turns kept, {out.interrupted} interrupted turns")
    assert out.damaged == [] and out.intact == RUNS
    assert out.interrupted >= 1              # the kills did land inside replies


APP_RUNS = 4            # about 5 s each (the window starts and loads the model every run)


def test_kill_9_of_the_app_while_it_streams_never_damages_a_conversation(tmp_path):
    """The same for K3 Studio (tests/fuzz/kill_app.py; the long run: `python -m
    tests.fuzz.kill_app --runs 200`)."""
    import pytest
    pytest.importorskip("PySide6", reason="the app's loop needs PySide6 (the [app] extra)")
    from fuzz.kill_app import run_kills as run_app_kills
    out = run_app_kills(APP_RUNS, seed=47, where=str(tmp_path))
    print(f"[gate] kill -9 of K3 Studio: {out.runs} runs, {out.intact} intact, "
          f"{out.turns_kept} completed turns kept, {out.interrupted} interrupted turns")
    assert out.damaged == [] and out.intact == APP_RUNS
