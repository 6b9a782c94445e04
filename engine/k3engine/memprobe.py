"""What the machine can hand out (SYSTEM §5.4): MemAvailable, capped by the tightest cgroup
(v2 or v1) on the way to the root, with a fail-closed answer for a control file that is
present but cannot be trusted; macOS and Windows figures where /proc is absent.  The only
I/O behind the memory plan; its roots are injectable so tests can build fake trees."""
from __future__ import annotations

import errno
import os
import subprocess
import sys
from dataclasses import dataclass

from .units import human

__all__ = ["MemProbe", "available_memory", "probe_memory"]

V1_UNLIMITED = 1 << 62       # cgroup v1 reports "no limit" as PAGE_COUNTER_MAX
MAX_CGROUP_ANCESTORS = 32


# --- available memory (§5.4) ------------------------------------------------------------

@dataclass(frozen=True)
class MemProbe:
    """What the machine can hand out, with the breakdown behind it.

    `bytes` is min(host, tightest cgroup headroom); 0 with `known` False means UNKNOWN
    (both refusals off, auto refuses); 0 with `malformed` True means a control file is
    present but untrustworthy: fail closed, the run refuses and prints `detail`."""

    bytes: int
    known: bool
    malformed: bool = False
    host: int | None = None            # MemAvailable (or the platform's figure)
    total: int | None = None           # MemTotal
    cgroup: int | None = None          # tightest finite headroom, None if unlimited/none
    cgroup_version: int = 0            # 2 or 1 when a cgroup supplied `cgroup`
    cgroup_limit: int | None = None
    cgroup_usage: int | None = None
    limit_path: str = ""
    detail: str = ""

    @property
    def how(self) -> str:
        if self.malformed:
            return f"fail closed: {self.detail}"
        if not self.known:
            return "unknown: no memory figure could be read"
        parts = []
        if self.host is not None:
            parts.append(f"host {human(self.host)} available")
        if self.cgroup is not None:
            parts.append(f"cgroup v{self.cgroup_version} {human(self.cgroup_limit or 0)} limit "
                         f"- {human(self.cgroup_usage or 0)} used at {self.limit_path}")
        binding = ("cgroup" if self.cgroup is not None
                   and (self.host is None or self.cgroup < self.host) else "host")
        return f"{human(self.bytes)} ({'; '.join(parts)}; {binding} binds)"


class _Malformed(Exception):
    """A control file that exists but cannot be trusted."""


def _read_u64(path: str) -> tuple[bool, int | None]:
    """(present, value): value None means unlimited ("max").  Absent files (ENOENT,
    ENOTDIR) are (False, None); anything present but not a non-negative integer raises."""
    try:
        with open(path, "rb") as f:
            raw = f.readline(64)
    except OSError as e:
        if e.errno in (errno.ENOENT, errno.ENOTDIR):
            return False, None
        raise _Malformed(f"cannot read {path}: {e.strerror or e}") from None
    text = raw.decode("ascii", "replace").rstrip("\r\n ")
    if not raw:
        raise _Malformed(f"{path} is empty")
    if text == "max":
        return True, None
    if not text.isdigit() or not text.isascii():
        raise _Malformed(f"{path} holds '{text}', not a byte count")
    return True, int(text)


def _walk(root: str, member: str, limit_name: str, usage_name: str, unlimited_at: int
          ) -> tuple[bool, int | None, int | None, int | None, str]:
    """One hierarchy: (seen, headroom, limit, usage, limit_path).  Starts at the nearest
    directory on the membership path that carries the limit file, then takes the
    tightest finite (limit - usage) up to the mounted root."""
    parts = [p for p in member.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise _Malformed(f"cgroup path '{member}' climbs out of the hierarchy")
    chain = [os.path.join(root, *parts[:k]) for k in range(len(parts), -1, -1)]
    chain = chain[:MAX_CGROUP_ANCESTORS]
    start = next((i for i, d in enumerate(chain)
                  if os.path.exists(os.path.join(d, limit_name))), None)
    if start is None:
        # Container runtimes mount the process's own subgroup as the root while
        # /proc still reports the host-side path.
        if not os.path.exists(os.path.join(root, limit_name)):
            return False, None, None, None, ""
        chain, start = [root], 0
    seen, best = False, (None, None, None, "")
    for d in chain[start:]:
        lpath = os.path.join(d, limit_name)
        present, lim = _read_u64(lpath)
        if not present:
            continue
        seen = True
        if lim is None or lim >= unlimited_at:
            continue
        upresent, use = _read_u64(os.path.join(d, usage_name))
        use = use if upresent and use is not None else 0
        head = max(lim - use, 0)
        if best[0] is None or head < best[0]:
            best = (head, lim, use, lpath)
    return (seen,) + best


def _memberships(path: str) -> tuple[str | None, str | None]:
    """(v2 path, v1 memory path) from /proc/self/cgroup.  A hybrid host lists v1 lines
    first, so match each line rather than taking the first."""
    try:
        with open(path, "r", encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return None, None
    v2 = v1 = None
    for line in lines:
        if not line:
            continue
        fields = line.split(":", 2)
        if len(fields) != 3:
            raise _Malformed(f"{path}: unparseable line '{line}'")
        hid, ctls, cpath = fields
        if hid == "0" and ctls == "":
            v2 = cpath
        elif "memory" in ctls.split(","):
            v1 = cpath
    return v2, v1


def _meminfo(path: str) -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        with open(path, "r", encoding="ascii", errors="replace") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("MemAvailable", "MemTotal"):
                    num = rest.split()
                    if num and num[0].isdigit():
                        out[key] = int(num[0]) * 1024
    except OSError:
        pass
    return out


def probe_memory(proc_root: str = "/proc", cgroup_root: str = "/sys/fs/cgroup") -> MemProbe:
    """The Linux probe against explicit roots: min(MemAvailable, tightest cgroup
    headroom); cgroup v2 is authoritative when its memory controller is visible, v1 only
    otherwise; a present but garbled control file fails closed."""
    info = _meminfo(os.path.join(proc_root, "meminfo"))
    host, total = info.get("MemAvailable"), info.get("MemTotal")
    try:
        v2, v1 = _memberships(os.path.join(proc_root, "self", "cgroup"))
        cg = (False, None, None, None, "")
        version = 0
        if v2 is not None:
            cg = _walk(cgroup_root, v2, "memory.max", "memory.current", 1 << 200)
            version = 2 if cg[0] else 0
        if not version and v1 is not None:
            cg = _walk(os.path.join(cgroup_root, "memory"), v1, "memory.limit_in_bytes",
                       "memory.usage_in_bytes", V1_UNLIMITED)
            if not cg[0]:
                cg = _walk(cgroup_root, v1, "memory.limit_in_bytes",
                           "memory.usage_in_bytes", V1_UNLIMITED)
            version = 1 if cg[0] else 0
    except _Malformed as e:
        return MemProbe(0, True, True, host=host, total=total, detail=str(e))
    _, head, lim, use, lpath = cg
    if host is None and head is None:
        return MemProbe(0, False, total=total)
    figure = min(x for x in (host, head) if x is not None)
    return MemProbe(figure, True, host=host, total=total, cgroup=head,
                    cgroup_version=version if head is not None else 0,
                    cgroup_limit=lim, cgroup_usage=use, limit_path=lpath)


def _probe_darwin() -> MemProbe:
    # free + inactive + purgeable pages: what Darwin gives up without paging out.
    try:
        text = subprocess.run(["vm_stat"], capture_output=True, text=True, timeout=5,
                              check=True).stdout
        lines = text.splitlines()
        page = int(lines[0].split("page size of")[1].split()[0])
        pages = {}
        for line in lines[1:]:
            k, _, v = line.partition(":")
            v = v.strip().rstrip(".")
            if v.isdigit():
                pages[k.strip()] = int(v)
        host = (pages.get("Pages free", 0) + pages.get("Pages inactive", 0)
                + pages.get("Pages purgeable", 0)) * page
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return MemProbe(0, False)
    total = None
    try:
        import psutil
        total = int(psutil.virtual_memory().total)
    except Exception:  # noqa: BLE001 - total is only auto's ceiling; unknown is allowed
        pass
    return MemProbe(host, host > 0, host=host, total=total)


def _probe_windows() -> MemProbe:
    # ullAvailPhys capped by the remaining commit limit: arenas are committed up front.
    import ctypes

    class MEMORYSTATUSEX(ctypes.Structure):
        _fields_ = [("dwLength", ctypes.c_ulong), ("dwMemoryLoad", ctypes.c_ulong),
                    ("ullTotalPhys", ctypes.c_ulonglong), ("ullAvailPhys", ctypes.c_ulonglong),
                    ("ullTotalPageFile", ctypes.c_ulonglong),
                    ("ullAvailPageFile", ctypes.c_ulonglong),
                    ("ullTotalVirtual", ctypes.c_ulonglong),
                    ("ullAvailVirtual", ctypes.c_ulonglong),
                    ("ullAvailExtendedVirtual", ctypes.c_ulonglong)]

    ms = MEMORYSTATUSEX()
    ms.dwLength = ctypes.sizeof(ms)
    if not ctypes.windll.kernel32.GlobalMemoryStatusEx(ctypes.byref(ms)):
        return MemProbe(0, False)
    host = min(ms.ullAvailPhys, ms.ullAvailPageFile)
    return MemProbe(host, True, host=host, total=ms.ullTotalPhys)


def available_memory(proc_root: str = "/proc", cgroup_root: str = "/sys/fs/cgroup"
                     ) -> tuple[int, MemProbe]:
    """(bytes a plan may use, the probe with its breakdown; `probe.how` describes it).

    Linux, or any platform when roots are given explicitly: `probe_memory`.  macOS and
    Windows use their platform figures (no cgroups)."""
    defaults = proc_root == "/proc" and cgroup_root == "/sys/fs/cgroup"
    if defaults and sys.platform == "darwin":
        probe = _probe_darwin()
    elif defaults and sys.platform == "win32":
        probe = _probe_windows()
    else:
        probe = probe_memory(proc_root, cgroup_root)
    return probe.bytes, probe
