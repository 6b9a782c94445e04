"""One typed settings object, persisted with QSettings (napari-style).

Every value the app remembers lives in `StudioSettings`; `load()` and `save()` convert it
to and from a flat QSettings store.  The store carries `version`; `MIGRATIONS` upgrades an
older store one version at a time before it is read, so renaming a field never silently
resets a person's choices.  Unknown or badly typed values fall back to the default for that
field only (a damaged settings file must not stop the app from starting).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from typing import Any, Callable

from PySide6.QtCore import QByteArray, QSettings

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
    threads: int = 0                  # 0 = the engine's default (OMP_NUM_THREADS / cores)
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
    """Bring a raw store up to SETTINGS_VERSION, one step at a time."""
    try:
        v = int(raw.get("version", 1))
    except (TypeError, ValueError):
        v = 1
    while v < SETTINGS_VERSION:
        step = MIGRATIONS.get(v)
        if step is not None:
            raw = step(dict(raw))
        v += 1
    raw["version"] = SETTINGS_VERSION
    return raw


def _coerce(kind: type, value: Any, default: Any) -> Any:
    """QSettings' INI backend hands strings back; turn them into the field's type."""
    try:
        if kind is bool:
            if isinstance(value, str):
                return value.strip().lower() in ("1", "true", "yes", "on")
            return bool(value)
        if kind is int:
            return int(float(value))
        if kind is float:
            return float(value)
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
    raw = {k: store.value(k) for k in store.allKeys()}
    raw = migrate(raw)
    out = StudioSettings()
    for f in fields(StudioSettings):
        if f.name in raw and raw[f.name] is not None:
            kind = _TYPES[f.type] if isinstance(f.type, str) else f.type
            setattr(out, f.name, _coerce(kind, raw[f.name], getattr(out, f.name)))
    out.version = SETTINGS_VERSION
    return out


def save(store: QSettings, s: StudioSettings) -> None:
    for f in fields(StudioSettings):
        v = getattr(s, f.name)
        store.setValue(f.name, QByteArray(v) if isinstance(v, bytes) else v)
    store.sync()
    _private(store.fileName())


def _private(path: str) -> None:
    """The settings hold the system prompt (conversation content): 0600, like histories.
    QSettings writes the file with the umask's mode, so it is narrowed after each sync."""
    import os
    try:
        if path and os.path.isfile(path):
            os.chmod(path, 0o600)
    except OSError:
        pass                        # a store we cannot chmod (not ours): leave it as it is


def replace(s: StudioSettings, **changes) -> StudioSettings:
    return dataclasses.replace(s, **changes)


def default_store() -> QSettings:
    """The per-user store (INI format on every platform so it is readable and diffable)."""
    from . import APP_NAME, ORG_NAME
    return QSettings(QSettings.IniFormat, QSettings.UserScope, ORG_NAME, APP_NAME)


__all__ = ["StudioSettings", "SETTINGS_VERSION", "MIGRATIONS", "migrate", "load", "save",
           "replace", "default_store", "field"]
