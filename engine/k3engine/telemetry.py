"""Structured run telemetry (SYSTEM §7.5): one event schema for the CLI's --events JSON
lines and the app's plots.  Every event carries "ev" and "t" (monotonic seconds since the
engine started); RSS comes from the OS, never from an estimate."""
from __future__ import annotations

import json
import os
import resource
import time
from typing import Callable

from .atomic import open_private

_T0 = time.monotonic()
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes() -> int:
    """Resident set now (/proc/self/statm field 2 x page size)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        import psutil
        return psutil.Process().memory_info().rss


def peak_rss_bytes() -> int:
    """This process's peak resident set from the OS: VmHWM where Linux has it (getrusage's
    ru_maxrss carries a parent's larger peak across fork + exec, vm_hwm_bytes), else
    getrusage (Linux and BSDs report KiB)."""
    hwm = vm_hwm_bytes()
    return hwm if hwm is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class PeakWindow:
    """The peak resident set since `reset()` -- per model load or per reply in the app.
    Left alone, the process peak never goes down, so after a bigger model it would keep
    reporting that one.  On Linux, writing 5 to /proc/self/clear_refs resets the kernel's
    VmHWM to the current RSS (Documentation/filesystems/proc.rst), and VmHWM is then read
    back: still the OS's own figure.  (It lowers getrusage's ru_maxrss for this process as
    well, so the per-step peaks of the engine are then per window too; the CLI never
    resets.)  Elsewhere the window's peak is the largest RSS sampled since the reset:
    `measured` says which ("VmHWM" or "samples")."""

    def __init__(self):
        self.measured = "VmHWM"
        self._floor = 0
        self.reset()

    def reset(self) -> None:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.measured, self._floor = "VmHWM", 0
        except OSError:
            self.measured, self._floor = "samples", rss_bytes()

    def sample(self, hwm: int | None = None) -> int:
        """The window's peak now.  `hwm`: VmHWM as the caller just read it (a step's
        telemetry has it), so a per-token sample does not read /proc a second time."""
        if self.measured == "VmHWM":
            hwm = hwm if hwm is not None else vm_hwm_bytes()
            if hwm is not None:
                return hwm
            self.measured = "samples"
        self._floor = max(self._floor, rss_bytes())
        return self._floor


def vm_hwm_bytes() -> int | None:
    """This process's own peak RSS: VmHWM of /proc/self/status (Linux), None elsewhere.
    The trap it avoids: getrusage's ru_maxrss survives fork + execve, so a run started
    from a big process (the app, a calibration) reports its parent's peak if larger."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


Sink = Callable[[dict], None]


class Events:
    """Fan-out of events to any number of sinks; a sink that raises is dropped (telemetry
    must never stop the engine)."""

    def __init__(self, *sinks: Sink):
        self.sinks = [s for s in sinks if s is not None]

    def emit(self, kind: str, /, **fields) -> None:
        if not self.sinks:
            return
        fields.pop("ev", None)                  # producers may pass their own copy
        fields.pop("t", None)
        e = {"ev": kind, "t": round(time.monotonic() - _T0, 6), **fields}
        for s in list(self.sinks):
            try:
                s(e)
            except Exception:
                self.sinks.remove(s)


class JsonLinesSink:
    """--events PATH: one JSON object per line, flushed per event."""

    def __init__(self, path: str):
        self.path = path
        self.error: OSError | None = None          # a failed write (full disk): reported
        self.f = open_private(path, "w", encoding="utf-8")    # events carry the text

    def __call__(self, e: dict) -> None:
        try:
            self.f.write(json.dumps(e, separators=(",", ":")) + "\n")
            self.f.flush()
        except OSError as err:          # the run goes on; the CLI exits 3 at the end
            self.error = err
            raise

    def close(self) -> None:
        try:
            self.f.close()
        except OSError as err:
            self.error = self.error or err
