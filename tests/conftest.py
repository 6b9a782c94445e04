"""Shared test plumbing: where the peer fixtures live, and exact/tolerance comparisons."""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

REPO = Path(__file__).resolve().parents[1]


def shared_dir() -> Path:
    return Path(os.environ.get("K3_SHARED", REPO.parent / "shared"))


def peer_dir() -> Path:
    """The reference's fixtures, read in place (never copied into the repo); tests that
    need them skip with the reason when they are absent."""
    d = shared_dir() / "fixtures" / "peer"
    if not d.is_dir():
        pytest.skip(f"shared fixtures not found at {d} (set K3_SHARED)")
    return d


def load_fixture(rel: str) -> dict:
    return json.loads((peer_dir() / rel).read_text())


def tens(fx: dict, key: str, dtype=np.float32) -> np.ndarray:
    t = fx[key]
    return np.asarray(t["data"], dtype=np.float64).astype(dtype).reshape(t["shape"])


def tolerance() -> tuple[float, float]:
    tol = load_fixture("ops/MANIFEST.json")["tolerance"]
    return float(tol["fp32_abs"]), float(tol["fp32_rel"])


def check_close(name: str, got: np.ndarray, want: np.ndarray) -> float:
    """Per element |got - want| <= atol + rtol*|want| (ARCHITECTURE §5.7); prints what it
    compared and the worst error as a fraction of the tolerance."""
    atol, rtol = tolerance()
    got = np.asarray(got, np.float64).reshape(np.shape(want))
    want = np.asarray(want, np.float64)
    assert np.all(np.isfinite(got)), f"{name}: non-finite output"
    ratio = float(np.max(np.abs(got - want) / (atol + rtol * np.abs(want)))) if want.size else 0.0
    print(f"[fixture] {name}: {want.size} values, worst error {ratio:.3f} x tolerance")
    assert ratio <= 1.0, f"{name}: worst error {ratio:.3f} x tolerance"
    return ratio


@pytest.fixture
def peer():
    return peer_dir()


# ---- print what the gates compared, even under -q with output captured ----------------

_GATE_PREFIXES = ("[gate]", "[fixture]", "[oracle]", "[cli]")
_gate_lines: list[str] = []


def pytest_runtest_logreport(report):
    if report.when == "call":
        for line in report.capstdout.splitlines():
            if line.startswith(_GATE_PREFIXES):
                _gate_lines.append(line)


def pytest_terminal_summary(terminalreporter):
    if _gate_lines:
        terminalreporter.section("what the gates compared")
        for line in _gate_lines:
            terminalreporter.write_line(line)
