"""Tier 3 through the real `k3` process: identical ids across budgets, ring depths,
threads, state-file resume; text prompts; stop ids; exit 4 and 5; the chat REPL."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine_helpers import GOLDEN_SEED, make_tiny
from test_cli import GOLDEN, PROMPT, k3

WANT = GOLDEN["generated_ids"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("sys") / "tiny", GOLDEN_SEED)


@pytest.fixture(scope="module")
def trunk(tiny, tmp_path_factory):
    d = tmp_path_factory.mktemp("sys") / "trunk"
    p = k3("pack-trunk", tiny, d)
    assert p.returncode == 0, p.stderr
    assert "wrote trunk.bin" in p.stdout and "largest layer run" in p.stdout
    return str(d)


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    d = tmp_path_factory.mktemp("sys") / "demo"
    assert k3("make-checkpoint", d, "--dims", "demo", "--seed", "9").returncode == 0
    return str(d)


def ids_of(out: Path) -> list[int]:
    return json.loads(out.read_bytes())["generated_ids"]


# Every row is a different memory layout; the ids must not move (SYSTEM §0).
LAYOUTS = {
    "resident": [],
    "resident, 1 thread": ["--threads", "1"],
    "trunk fully pinned": ["--trunk", "{t}", "--trunk-gb", "1"],
    "nothing pinned, ring 1": ["--trunk", "{t}", "--trunk-gb", "0", "--trunk-ring", "1"],
    "nothing pinned, ring 2": ["--trunk", "{t}", "--trunk-gb", "0", "--trunk-ring", "2"],
    "nothing pinned, ring 3": ["--trunk", "{t}", "--trunk-gb", "0", "--trunk-ring", "3"],
    "smallest cache (top-k + 1 slots)": ["--trunk", "{t}", "--trunk-gb", "0.0012",
                                         "--cache-gb", "0.000062"],
    "preset laptop": ["--trunk", "{t}", "--preset", "laptop"],
    "preset auto": ["--trunk", "{t}", "--preset", "auto"],
    "2 threads, full recompute": ["--trunk", "{t}", "--trunk-gb", "0.001", "--threads", "2",
                                  "--no-incremental"],
    "ultra (embedding and lm_head streamed)": ["--trunk", "{t}", "--preset", "ultra"],
    "ultra, full recompute, one state slot": ["--trunk", "{t}", "--preset", "ultra",
                                              "--no-incremental"],
}


def test_ultra_refusals(tiny, trunk):
    p = k3(tiny, "--ids", "1", "--ultra-low-memory")
    assert p.returncode == 2 and "needs --trunk" in p.stderr
    p = k3(tiny, "--ids", "1", "--trunk", trunk, "--preset", "auto", "--ultra-low-memory")
    assert p.returncode == 2 and "--ultra-low-memory" in p.stderr
    p = k3(tiny, "--ids", "1", "--trunk", trunk, "--preset", "ultra", "--incremental",
           "--spec", "2")
    assert p.returncode == 2 and "--spec" in p.stderr


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_ids_identical_across_memory_layouts(tiny, trunk, tmp_path, name):
    args = [a.format(t=trunk) for a in LAYOUTS[name]]
    inc = [] if "--no-incremental" in args else ["--incremental"]
    args = [a for a in args if a != "--no-incremental"]
    out = tmp_path / "o.json"
    p = k3(tiny, "--ids", PROMPT, "--gen", 8, *inc, *args, "--out", out)
    assert p.returncode == 0, p.stderr[-2000:]
    got = ids_of(out)
    print(f"[gate] {name}: {got} vs golden {WANT[:8]}")
    assert got == WANT[:8]


def test_failed_save_state_keeps_the_exit_code(tiny, tmp_path):
    """SYSTEM §6.5/§6.9: a --save-state that cannot be written prints `failed writing PATH:
    <reason>` and leaves no file, but the run's own exit code stands (0 here; it was 1),
    and its results are still written."""
    st = tmp_path / "no such dir" / "s.k3st"
    p = k3(tiny, "--ids", "1,2,3", "--gen", 2, "--incremental", "--save-state", st,
           "--out", tmp_path / "o.json")
    print(f"[gate] save into a missing directory: exit {p.returncode}, "
          f"stderr {p.stderr.strip().splitlines()[-1:]}")
    assert p.returncode == 0, p.stderr
    assert f"failed writing {st}" in p.stderr and "Traceback" not in p.stderr
    assert not st.parent.exists()
    assert len(ids_of(tmp_path / "o.json")) == 2


def test_state_file_resume_equals_uninterrupted_run(tiny, tmp_path):
    st = tmp_path / "s.k3st"
    head, tail = GOLDEN["prompt_ids"][:7], GOLDEN["prompt_ids"][7:]
    a = k3(tiny, "--ids", ",".join(map(str, head)), "--gen", 3, "--incremental",
           "--save-state", st, "--out", tmp_path / "a.json")
    assert a.returncode == 0 and f"wrote {st}" in a.stdout, a.stderr
    first = ids_of(tmp_path / "a.json")
    b = k3(tiny, "--ids", ",".join(map(str, tail)), "--gen", 6, "--incremental",
           "--load-state", st, "--out", tmp_path / "b.json")
    assert b.returncode == 0, b.stderr
    assert "resuming from" in b.stdout
    c = k3(tiny, "--ids", ",".join(map(str, head + first + tail)), "--gen", 6,
           "--incremental", "--out", tmp_path / "c.json")
    assert c.returncode == 0, c.stderr
    print(f"[gate] resume: {ids_of(tmp_path / 'b.json')} vs uninterrupted "
          f"{ids_of(tmp_path / 'c.json')}")
    assert ids_of(tmp_path / "b.json") == ids_of(tmp_path / "c.json")
    jb = json.loads((tmp_path / "b.json").read_bytes())
    assert jb["full_ids"] == head + first + tail + jb["generated_ids"]
    # a damaged state file is refused before generating (exit 1), naming the file
    raw = bytearray(st.read_bytes())
    raw[-3] ^= 0x40
    bad = tmp_path / "bad.k3st"
    bad.write_bytes(bytes(raw))
    p = k3(tiny, "--ids", "1", "--gen", 1, "--incremental", "--load-state", bad)
    assert p.returncode == 1 and "does not match the hash its header declares" in p.stderr


def test_stop_id_ends_the_run_after_emitting_it(tiny, tmp_path):
    out = tmp_path / "o.json"
    p = k3(tiny, "--ids", PROMPT, "--gen", 8, "--incremental", "--stop-id", WANT[2],
           "--stop-id", 999 % 256, "--out", out)
    j = json.loads(out.read_bytes())
    assert p.returncode == 0 and j["generated_ids"] == WANT[:3] and j["stopped_at"] == WANT[2]
    assert f"stop id {WANT[2]} reached after 3 of 8 tokens" in p.stdout
    many = []
    for i in range(9):
        many += ["--stop-id", i]
    assert k3(tiny, "--ids", "1", *many).returncode == 2


def test_text_prompt_and_generated_text(demo, tmp_path):
    out = tmp_path / "o.json"
    pf = tmp_path / "prompt.txt"
    pf.write_text("Grüße, 世界! <|open|>", encoding="utf-8")
    p = k3(demo, "--prompt-file", pf, "--tok", demo, "--gen", 4, "--incremental", "--out", out)
    assert p.returncode == 0, p.stderr
    assert "tokenized:" in p.stdout and "--- generated text ---" in p.stdout
    j = json.loads(out.read_bytes().decode("utf-8", errors="replace"))
    assert len(j["generated_ids"]) == 4 and j["generated_text"] is not None
    from k3engine.tokenizer import Tokenizer
    tok = Tokenizer.from_dir(demo)
    assert j["prompt_ids"] == tok.encode(pf.read_text(encoding="utf-8"), True)
    assert tok.id_of("<|open|>") in j["prompt_ids"]          # specials allowed in batch
    assert k3(demo, "--prompt", "hi").returncode == 2         # needs --tok


def test_expert_failure_exits_4_without_emitting(tiny, tmp_path):
    out = tmp_path / "o.json"
    env = {"K3_FAIL_EXPERT": "2,*"}
    p = k3(tiny, "--ids", PROMPT, "--gen", 4, "--incremental", "--out", out, env=env)
    assert p.returncode == 4, p.stderr[-1500:]
    assert "RUN INVALID" in p.stderr and "layer 2 expert" in p.stderr
    j = json.loads(out.read_bytes())
    print(f"[gate] injected expert failure: exit {p.returncode}, emitted {j['generated_ids']} "
          f"(the failing step's token is not among them), drops {j['expert_drops']}")
    assert j["expert_drops"] >= 1 and j["generated_ids"] == WANT[:len(j["generated_ids"])]


def test_events_stream(tiny, tmp_path):
    ev = tmp_path / "ev.jsonl"
    p = k3(tiny, "--ids", PROMPT, "--gen", 3, "--incremental", "--events", ev,
           "--out", tmp_path / "o.json")
    assert p.returncode == 0
    events = [json.loads(line) for line in ev.read_text().splitlines()]
    kinds = [e["ev"] for e in events]
    assert kinds[0] == "plan" and kinds.count("step") == 3 and kinds[-1] == "summary"
    steps = [e for e in events if e["ev"] == "step"]
    assert all(e["rss_bytes"] > 0 and e["peak_rss_bytes"] > 0 for e in steps)
    assert [i for e in steps for i in e["ids"]] == WANT[:3]


def test_list_presets():
    p = k3("--list-presets")
    assert p.returncode == 0
    for name in ("ultra", "laptop", "desktop", "workstation", "server", "max"):
        assert name in p.stdout


def _spawn(*args):
    return subprocess.Popen([sys.executable, "-m", "k3engine", *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_step(proc, first_row: str = "0      ") -> list[str]:
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith(first_row):
            return lines
    raise AssertionError("no step row: " + "".join(lines[-20:]) + proc.stderr.read())


def test_first_sigint_finishes_the_step_and_exits_5(demo, tmp_path):
    out = tmp_path / "o.json"
    st = tmp_path / "s.k3st"
    proc = _spawn(demo, "--ids", "1,2,3", "--gen", 4000, "--out", out, "--incremental",
                  "--save-state", st)
    _wait_for_step(proc)
    proc.send_signal(signal.SIGINT)
    rest, err = proc.communicate(timeout=120)
    j = json.loads(out.read_bytes())
    print(f"[gate] SIGINT: exit {proc.returncode}, {len(j['generated_ids'])} tokens, "
          f"interrupted={j['interrupted']}, state file written {st.exists()}")
    assert proc.returncode == 5, err
    assert "interrupt: the step in flight will complete" in err
    assert j["interrupted"] is True and 1 <= len(j["generated_ids"]) < 4000
    assert st.exists() and "interrupted:" in rest


def test_second_sigint_kills(demo, tmp_path):
    # full recompute of a long prompt: each step takes long enough to signal twice inside it
    long_prompt = ",".join(str(i % 4000) for i in range(1500))
    proc = _spawn(demo, "--ids", long_prompt, "--gen", 4000, "--out", tmp_path / "o.json")
    _wait_for_step(proc)
    time.sleep(0.5)              # inside step 1 (~6 s), not between steps 0 and 1
    proc.send_signal(signal.SIGINT)
    # the handler runs when the main thread is back in Python; only then is the default
    # action restored, so wait for its message before the second signal
    for line in proc.stderr:
        if "Press Ctrl-C again" in line:
            break
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGINT


def test_chat_repl(demo, tmp_path):
    hist = tmp_path / "h.jsonl"
    p = subprocess.run([sys.executable, "-m", "k3engine", demo, "--chat", "--tok", demo,
                        "--gen", "3", "--history", str(hist), "--system", "Be brief."],
                       input="/help\nHello there\n", capture_output=True, text=True, timeout=300)
    # random weights never close a turn: exit 1, transcript kept (SYSTEM §9.3)
    assert p.returncode == 1, p.stderr[-1500:]
    assert "/reset clear this conversation" in p.stdout
    assert "did not complete an official turn within --gen 3; transcript is preserved" in p.stderr
    assert "XTML prompt:" in p.stdout and "chat: token 3/3" in p.stderr
    lines = [json.loads(x) for x in hist.read_text().splitlines()]
    assert lines == [{"role": "system", "content": "Be brief."},
                     {"role": "user", "content": "Hello there"}]
    q = subprocess.run([sys.executable, "-m", "k3engine", demo, "--chat", "--tok", demo],
                       input="/exit\n", capture_output=True, text=True, timeout=60)
    assert q.returncode == 0
    assert k3(demo, "--chat", "--tok", demo, "--ids", "1").returncode == 2
    assert k3(demo, "--chat", "--tok", demo, "--no-think", "--thinking-effort", "low").returncode == 2


def test_first_touch_progress_events(tiny, trunk, tmp_path):
    ev = tmp_path / "ev.jsonl"
    p = k3(tiny, "--ids", PROMPT, "--gen", 2, "--incremental", "--trunk", trunk,
           "--trunk-gb", "1", "--events", ev, "--out", tmp_path / "o.json")
    assert p.returncode == 0, p.stderr
    loads = [json.loads(x) for x in ev.read_text().splitlines() if '"ev":"load"' in x]
    assert loads and all(e["phase"] == "pinned_first_touch" for e in loads)
    done = [e["done_bytes"] for e in loads]
    assert done == sorted(done) and done[-1] == loads[-1]["total_bytes"]
    print(f"[gate] first-touch progress: {len(loads)} events, {done[-1]} of "
          f"{loads[-1]['total_bytes']} pinned bytes")


def test_chat_expert_failure_exits_4(demo):
    p = subprocess.run([sys.executable, "-m", "k3engine", demo, "--chat", "--tok", demo,
                        "--gen", "3"], input="Hello\n", capture_output=True, text=True,
                       timeout=300, env={**os.environ, "K3_FAIL_EXPERT": "2,*"})
    assert p.returncode == 4, p.stderr[-1500:]
    assert "chat invalid" in p.stderr and "Traceback" not in p.stderr


def test_after_a_first_sigint_the_default_action_stays_while_results_are_written():
    """A first Ctrl-C that lands between two steps ends the loop at once and the run goes on
    to write its files; a second Ctrl-C then must still kill the process, so leaving the
    decode loop must not reinstall Python's KeyboardInterrupt handler (which would raise
    into a half-written report).  Without a first Ctrl-C the old handler comes back."""
    from k3engine.cli import Interrupts
    from k3engine.generate import Cancel
    before = signal.getsignal(signal.SIGINT)
    with Interrupts(Cancel()):
        assert signal.getsignal(signal.SIGINT) is not before
    assert signal.getsignal(signal.SIGINT) is before
    try:
        with Interrupts(Cancel()) as it:
            it._handler(signal.SIGINT, None)       # what the first Ctrl-C runs
        assert signal.getsignal(signal.SIGINT) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGINT, before)
