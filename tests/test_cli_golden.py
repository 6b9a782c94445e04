"""The front ends' output is part of the contract: every golden run of cli_golden.py
(stdout, stderr, --out, --events, the chat history) replays byte for byte after masking
what varies by machine (times, RSS, rates, temporary paths)."""
from __future__ import annotations

import json

import pytest

import cli_golden as G


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return G.models(tmp_path_factory.mktemp("golden"))


@pytest.mark.parametrize("name", sorted(G.RUNS))
def test_golden_run_unchanged(name, paths, tmp_path):
    want = json.loads(G.golden_path(name).read_text())
    got = G.run_one(name, paths, tmp_path)
    print(f"[cli] golden {name}: exit {got['exit']}, compared {', '.join(sorted(want))}")
    assert sorted(got) == sorted(want), f"{name}: outputs {sorted(got)} != {sorted(want)}"
    for key in want:
        assert got[key] == want[key], f"{name}: {key} differs"
