"""Where a remote endpoint's API key is kept: never in QSettings (a plain-text INI file).

The OS keyring through `keyring` when it has a real backend (Secret Service, macOS
Keychain, Windows Credential Locker); otherwise a JSON file created 0600 in the app's data
directory, written atomically.  `where()` says which, and the Setup panel shows it.
K3STUDIO_KEY_STORE=file forces the file (headless tests, machines whose keyring prompts).
"""
from __future__ import annotations

import json
import os

from .damaged import DamagedFile, move_aside, read_json_object

SERVICE = "K3 Studio remote endpoint"
FILE_NAME = "remote_keys.json"


def _keyring():
    """The keyring module when its backend can store secrets, else None."""
    if os.environ.get("K3STUDIO_KEY_STORE") == "file":
        return None
    try:
        import keyring
        from keyring.backends import fail
        kr = keyring.get_keyring()
    except Exception:                 # not installed, or a backend that fails to start
        return None
    chained = getattr(kr, "backends", None)
    if isinstance(kr, fail.Keyring) or (chained is not None and not chained) or \
            getattr(kr, "priority", 1) <= 0:
        return None
    return keyring


class KeyStore:
    def __init__(self, data_dir: str):
        self.path = os.path.join(data_dir, FILE_NAME)
        self._kr = _keyring()

    def where(self) -> str:
        if self._kr is not None:
            return f"the OS keyring ({type(self._kr.get_keyring()).__name__})"
        return f"{self.path} (mode 0600; no OS keyring backend here)"

    def get(self, url: str) -> str:
        if self._kr is not None:
            return self._kr.get_password(SERVICE, url) or ""
        return self._read().get(url, "")

    def set(self, url: str, key: str) -> None:
        if self._kr is not None:
            if key:
                self._kr.set_password(SERVICE, url, key)
            elif self._kr.get_password(SERVICE, url) is not None:
                self._kr.delete_password(SERVICE, url)
            return
        keys = self._read()
        if key:
            keys[url] = key
        else:
            keys.pop(url, None)
        self._write(keys)

    def _read(self) -> dict:
        """The stored keys.  A file that cannot be read, or holds an entry that is not a
        URL and its key (text), is moved aside to damaged/ (damaged.py) with every key in
        it, never overwritten by the next save (issue 47: the other keys were lost); its
        well-formed entries are written back."""
        try:
            data = read_json_object(self.path, "key file") or {}
        except DamagedFile as e:
            move_aside(self.path, e.problem)
            return {}
        keys = {k: v for k, v in data.items() if isinstance(v, str)}
        if len(keys) != len(data):
            move_aside(self.path, f"{len(data) - len(keys)} entries are not text keys")
            self._write(keys)           # the good ones stay where get() finds them
        return keys

    def _write(self, keys: dict) -> None:
        from k3engine.atomic import write_atomic
        folder = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(folder, exist_ok=True)
        write_atomic(self.path, json.dumps(keys).encode("utf-8"), mode=0o600, inside=folder)
