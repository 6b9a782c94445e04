"""The CLI's own inputs and outputs under hostile or unlucky conditions (issue 14, the call
sites in the front end): non-ASCII digits, huge numbers, FIFOs, unwritable --events,
--dump-logits and --dump-cache-trace targets, a history held by another chat."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from engine_helpers import GOLDEN_SEED, make_tiny
from test_cli import PROMPT, k3


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("outs") / "tiny", GOLDEN_SEED)


@pytest.mark.parametrize("args, message", [
    (["--ids", "١,٢"], "ASCII"),
    (["--ids", "1", "--gen", "²"], "expected a whole number"),
    (["--ids", "1", "--gen", "9" * 5000], "expected a whole number"),
    (["--ids", "1", "--events", "/proc/no/such.jsonl"], "cannot write --events"),
])
def test_refused_up_front_exit_2(tiny, tmp_path, args, message):
    p = k3(tiny, *args, "--out", tmp_path / "o.json")
    assert p.returncode == 2, p.stderr[-500:]
    assert message in p.stderr and "Traceback" not in p.stderr
    assert not (tmp_path / "o.json").exists()


def test_ids_file_fifo_is_refused_not_waited_on(tiny, tmp_path):
    fifo = tmp_path / "ids"
    os.mkfifo(fifo)
    t0 = time.monotonic()
    p = k3(tiny, "--ids-file", fifo, "--out", tmp_path / "o.json")
    print(f"[cli] --ids-file FIFO: exit {p.returncode} in {time.monotonic() - t0:.1f} s")
    assert p.returncode == 2 and "not a regular file" in p.stderr


def test_unwritable_dump_logits_and_trace_exit_3_with_the_results_kept(tiny, tmp_path):
    trace = tmp_path / "trace"
    trace.mkdir()
    (trace / "expert_hist.json").mkdir()           # a directory where the file must go
    out = tmp_path / "o.json"
    p = k3(tiny, "--ids", PROMPT, "--gen", "2", "--dump-logits", "/proc/no/such.bin",
           "--dump-cache-trace", trace, "--out", out)
    assert p.returncode == 3, p.stderr[-800:]
    assert "cannot write /proc/no/such.bin" in p.stderr
    assert "cannot write the cache trace" in p.stderr and "Traceback" not in p.stderr
    assert json.loads(out.read_bytes())["generated_ids"]           # --out was written


def test_dump_cache_trace_says_once_what_it_wrote(tiny, tmp_path):
    p = k3(tiny, "--ids", PROMPT, "--gen", "2", "--dump-cache-trace", tmp_path, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-800:]
    said = [l for l in p.stdout.splitlines() if str(tmp_path) in l]
    print(f"[cli] --dump-cache-trace: {said}")
    assert [l.split(":")[0] for l in said] == [f"wrote {tmp_path / 'expert_hist.json'}",
                                               f"wrote {tmp_path / 'expert_trace.bin'}"]
    assert (tmp_path / "expert_trace.bin").stat().st_size > 0


def test_second_chat_on_one_history_is_refused(tiny, tmp_path):
    from k3engine.tools.make_checkpoint import dims_config, make_checkpoint
    demo = tmp_path / "demo"
    make_checkpoint(str(demo), dims_config("demo"), seed=9)
    hist = tmp_path / "h.jsonl"
    first = subprocess.Popen([sys.executable, "-m", "k3engine", str(demo), "--chat", "--tok",
                              str(demo), "--history", str(hist)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first.stdout.read(6)                        # "user> ": it holds the lock now
        p = k3(demo, "--chat", "--tok", demo, "--history", hist)
        assert p.returncode == 2 and "in use by another k3 chat" in p.stderr
    finally:
        first.communicate("/exit\n", timeout=120)
    assert first.returncode == 0
