"""One typed settings object, persisted with QSettings (napari-style).

Every value the app remembers lives in `StudioSettings`; `load()` and `save()` convert it
to and from a flat QSettings store.  The store carries `version`; `MIGRATIONS` upgrades an
older store one version at a time before it is read, so renaming a field never silently
resets a person's choices.  Unknown or badly typed values fall back to the default for that
field only, and numbers outside what the app can use are clamped, each with the reason
logged (a damaged settings file must not stop the app from starting: issue 47 found
threads=inf, trunk_gb=nan, a 20-digit gen and version=-99999999999 aborting or hanging it).
A settings file that is not a regular file of sane size (a FIFO hangs QSettings, a link to
/dev/zero exhausts memory) is moved aside to damaged/ before QSettings opens it.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import os
from dataclasses import dataclass, field, fields
from typing import Any, Callable

from PySide6.QtCore import QByteArray, QSettings

from .damaged import DamagedFile, check_regular, move_aside

log = logging.getLogger("k3studio")
SETTINGS_LIMIT = 1 << 20          # a settings file of ours is a few kB

SETTINGS_VERSION = 2


@dataclass
class StudioSettings:
    version: int = SETTINGS_VERSION
    # setup: where the model, its packed trunk and its tokenizer live ("" = not chosen)
    model_dir: str = ""
    trunk_dir: str = ""
    tok_dir: str = ""                 # "" = the model directory itself
    demo_offered: bool = False        # the first-start offer was shown once
    # memory: preset name, or "custom" when the sliders were moved away from one
    preset: str = "laptop"
    trunk_gb: float = 3.0
    cache_gb: float = 1.0
    trunk_ring: int = 2
    cache_policy: str = "lru"         # expert replacement: "lru" (the reference's), "s3fifo"
    lookahead: bool = True            # expert reads from a guess of the router (--no-lookahead)
    threads: int = 0                  # 0 = the engine's default (OMP_NUM_THREADS / cores)
    draft_model: str = ""             # a block drafter folder (--draft-model); "" = none
    # chat
    gen: int = 256                    # generation limit per reply (--gen)
    thinking: bool = True
    effort: str = "low"
    system_prompt: str = ""
    greedy: bool = True
    temperature: float = 1.0
    top_p: float = 0.95
    top_k: int = 0
    seed: int = 0                     # 0 with sampling on = a fresh clock seed
    conversation_path: str = ""       # the open conversation's file (reopened on start)
    # look: "system" follows the platform's colour scheme, or "light" / "dark"
    theme: str = "system"
    # backend: "local" (this machine's engine) or "remote"; the key is in secrets_store
    backend: str = "local"
    remote_url: str = ""
    remote_model: str = ""
    serve_port: int = 0               # the app's k3 serve port, kept across on/off (0: free)
    serve_slots: int = 0              # its --parallel (0: the most the plan fits, up to 4)
    # window
    geometry: bytes = b""
    splitter: bytes = b""             # conversation list | chat | side panel (0 = collapsed)
    side_tab: int = 0                 # the side panel's page: telemetry or settings
    details: bool = False             # the engine's vocabulary shown (stats, plots, memory)
    tab: int = 0


def _migrate_1_to_2(raw: dict[str, Any]) -> dict[str, Any]:
    # v1 stored the expert-cache budget as "expert_cache_gb" and the effort as "effort_level".
    if "expert_cache_gb" in raw:
        raw.setdefault("cache_gb", raw.pop("expert_cache_gb"))
    if "effort_level" in raw:
        raw.setdefault("effort", raw.pop("effort_level"))
    return raw


# version N -> function producing version N + 1
MIGRATIONS: dict[int, Callable[[dict[str, Any]], dict[str, Any]]] = {1: _migrate_1_to_2}


def migrate(raw: dict[str, Any]) -> dict[str, Any]:
    """Bring a raw store up to SETTINGS_VERSION, one step at a time (a version below 1 is
    read as 1: counting up from -99999999999 hung the start)."""
    v = _number(int, raw.get("version", 1))
    if v is None or v < 1:
        log.warning("settings: version %.40r is not a settings version; read as 1",
                    raw.get("version"))
        v = 1
    for n in range(v, SETTINGS_VERSION):
        step = MIGRATIONS.get(n)
        if step is not None:
            raw = step(dict(raw))
    raw["version"] = SETTINGS_VERSION
    return raw


def _number(kind: type, value: Any) -> int | float | None:
    """`value` (QSettings' INI backend hands strings back) as a finite int or float, else
    None: inf, nan and unparsable text are not numbers a field can hold."""
    try:
        if isinstance(value, str):
            value = value.strip()
            if kind is int and value.lstrip("+-").isdigit():
                return int(value)          # exact, with no float rounding on the way
        x = float(value)
    except (TypeError, ValueError, OverflowError):
        return None
    if not math.isfinite(x):
        return None
    return int(x) if kind is int else x


# What each number may be (the widgets' own ranges, chat_panel.py and memory_panel.py):
# a value outside is clamped with the reason logged, never passed to a widget or the engine.
RANGES: dict[str, tuple[float, float]] = {
    "trunk_gb": (0.0, 100000.0), "cache_gb": (0.0, 100000.0), "trunk_ring": (1, 8),
    "threads": (0, 4096), "gen": (1, 4096), "temperature": (0.01, 5.0), "top_p": (0.01, 1.0),
    "top_k": (0, 100000), "seed": (0, 2**31 - 1), "tab": (0, 64), "side_tab": (0, 64),
    "serve_slots": (0, 64), "serve_port": (0, 65535)}   # an int QSettings cannot store
                                                        # would fail the save (test_fuzz)
CHOICES: dict[str, tuple[str, ...]] = {
    "cache_policy": ("lru", "s3fifo"), "theme": ("system", "light", "dark"),
    "backend": ("local", "remote"), "effort": ("low", "high", "max")}


def _coerce(kind: type, value: Any, default: Any) -> Any:
    """QSettings' INI backend hands strings back; turn them into the field's type."""
    try:
        if kind is bool:
            if isinstance(value, str):
                return value.strip().lower() in ("1", "true", "yes", "on")
            return bool(value)
        if kind in (int, float):
            x = _number(kind, value)
            return default if x is None else x
        if kind is bytes:
            if isinstance(value, QByteArray):
                return bytes(value.data())
            if isinstance(value, (bytes, bytearray)):
                return bytes(value)
            return default
        if kind is str:
            return "" if value is None else str(value)
    except (TypeError, ValueError):
        return default
    return default


_TYPES = {"bool": bool, "int": int, "float": float, "str": str, "bytes": bytes}


def load(store: QSettings) -> StudioSettings:
    if store.status() == QSettings.FormatError and _is_file_store(store):
        move_aside(store.fileName(), "not a settings file QSettings can parse")
        store.clear()
    raw = {k: store.value(k) for k in store.allKeys()}
    raw = migrate(raw)
    out = StudioSettings()
    for f in fields(StudioSettings):
        if f.name in raw and raw[f.name] is not None:
            kind = _TYPES[f.type] if isinstance(f.type, str) else f.type
            default = getattr(out, f.name)
            if kind in (int, float) and _number(kind, raw[f.name]) is None:
                log.warning("settings: %s = %.40r is not a finite number; the default %r is "
                            "used", f.name, raw[f.name], default)
            value = _coerce(kind, raw[f.name], default)
            setattr(out, f.name, _valid(f.name, value, default))
    out.version = SETTINGS_VERSION
    return out


def _valid(name: str, value: Any, default: Any) -> Any:
    if name in RANGES:
        lo, hi = RANGES[name]
        if not lo <= value <= hi:
            clamped = type(value)(min(max(value, lo), hi))
            log.warning("settings: %s = %.40r is outside %s..%s; %r is used", name, value,
                        lo, hi, clamped)
            return clamped
    if name in CHOICES and value not in CHOICES[name]:
        log.warning("settings: %s = %.40r is not one of %s; the default %r is used", name,
                    value, ", ".join(CHOICES[name]), default)
        return default
    return value


def save(store: QSettings, s: StudioSettings) -> None:
    for f in fields(StudioSettings):
        v = getattr(s, f.name)
        store.setValue(f.name, QByteArray(v) if isinstance(v, bytes) else v)
    if _is_file_store(store):
        _private(store.fileName())
    store.sync()


def _is_file_store(store: QSettings) -> bool:
    return store.format() == QSettings.IniFormat and bool(store.fileName())


def _private(path: str) -> None:
    """The settings hold the system prompt (conversation content): the file exists 0600
    before QSettings writes it (QSettings keeps an existing file's mode, and creates a new
    one with the umask's: a window in which it was world-readable, issue 47).  It is opened
    O_NOFOLLOW: a link or FIFO planted at its name is moved aside first, never chmod'ed or
    written through."""
    from k3engine.atomic import open_nofollow
    try:
        check_regular(path, SETTINGS_LIMIT)
    except DamagedFile as e:
        move_aside(path, e.problem)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = open_nofollow(path, os.O_WRONLY | os.O_CREAT, 0o600)
    except OSError as e:
        log.warning("settings: cannot prepare %s (%s)", path, e.strerror or e)
        return
    try:
        os.fchmod(fd, 0o600)
    except OSError:
        pass                        # a store we cannot chmod (not ours): leave it as it is
    finally:
        os.close(fd)


def replace(s: StudioSettings, **changes) -> StudioSettings:
    return dataclasses.replace(s, **changes)


def default_store() -> QSettings:
    """The per-user store (INI format on every platform so it is readable and diffable).
    Its file is checked before QSettings reads it (see the module docstring); where it is
    comes from a probe store of another name in the same folder (QSettings' own path
    rules), which reads nothing that exists."""
    from . import APP_NAME, ORG_NAME
    probe = QSettings(QSettings.IniFormat, QSettings.UserScope, ORG_NAME, APP_NAME + PROBE)
    folder = os.path.dirname(probe.fileName())
    del probe
    check_store_file(os.path.join(folder, APP_NAME + ".ini"))
    return QSettings(QSettings.IniFormat, QSettings.UserScope, ORG_NAME, APP_NAME)


PROBE = " (path probe)"


def check_store_file(path: str) -> None:
    """Move a settings file that QSettings must not open (link, FIFO, device, too big)
    aside, so the app starts with defaults and says so."""
    try:
        check_regular(path, SETTINGS_LIMIT)
    except DamagedFile as e:
        move_aside(path, e.problem)


__all__ = ["StudioSettings", "SETTINGS_VERSION", "MIGRATIONS", "migrate", "load", "save",
           "replace", "default_store", "field"]
