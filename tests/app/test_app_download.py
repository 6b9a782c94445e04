"""Download panel against the loopback fake hub of tests/test_download.py: a fresh download,
a dropped connection, a paused download resumed by a new panel (a restart), a corrupt shard
named and re-fetched, and the token stored safely."""
from __future__ import annotations

import stat

import pytest

from .app_helpers import TIMEOUT

pytest.importorskip("huggingface_hub", reason="huggingface_hub (the download dependency) is "
                    "not installed")

from test_download import TOKEN, FakeHub, hub_env, shard_names, source  # noqa: E402,F401

from k3studio import download_panel as D  # noqa: E402


@pytest.fixture
def hub(source):
    h = FakeHub(source)
    yield h
    h.close()


@pytest.fixture
def no_keyring(monkeypatch):
    monkeypatch.setattr(D, "_keyring", lambda: None)


def panel_for(qtbot, hub, dest, tmp_path, token=TOKEN):
    p = D.DownloadPanel(config_dir=str(tmp_path / "config"))
    qtbot.addWidget(p)
    p.repo.setText(hub.repo)
    p.endpoint.setText(hub.endpoint)
    p.dest.setText(str(dest))
    p.token.setText(token or "")
    return p


def run_to_end(qtbot, p) -> dict:
    with qtbot.waitSignal(p.finished, timeout=TIMEOUT) as blocker:
        p.start_btn.click()
    return blocker.args[0]


def test_fresh_download_with_progress(qtbot, hub, source, tmp_path, no_keyring):
    dest = tmp_path / "model"
    p = panel_for(qtbot, hub, dest, tmp_path)
    res = run_to_end(qtbot, p)
    assert res["code"] == 0 and res["bad"] == []
    for name, data in source.items():
        assert (dest / name).read_bytes() == data
    shards = shard_names(source)
    names = [p.files.item(r, 0).text() for r in range(p.files.rowCount())]
    assert set(shards) <= set(names)                       # a row per file fetched
    assert all(p.files.cellWidget(r, 2).value() == 1000 for r in range(p.files.rowCount()))
    assert p.overall.value() == 1000
    log = p.log.toPlainText()
    assert "OK: " in log and "verified" in log
    assert TOKEN not in log                                # masked, never shown
    assert "pack the trunk" in p.status.text()


def test_dropped_connection_is_resumed(qtbot, hub, source, tmp_path, no_keyring):
    shard = shard_names(source)[2]
    cut = len(source[shard]) // 2
    hub.truncate[shard] = [1, cut]
    dest = tmp_path / "model"
    res = run_to_end(qtbot, panel_for(qtbot, hub, dest, tmp_path))
    assert res["code"] == 0
    gets = [r for r in hub.blob_gets() if r["name"] == shard]
    assert [r["range"] for r in gets] == [None, f"bytes={cut}-"]
    assert (dest / shard).read_bytes() == source[shard]


def test_pause_then_a_restarted_panel_resumes(qtbot, hub, source, tmp_path, no_keyring,
                                              monkeypatch):
    shard = shard_names(source)[3]
    fired = []
    real = D.PanelOut.progress

    def pause_on_first_chunk(self, name, have, size):
        if name == shard and not fired:
            fired.append(have)
            self.pause.set()                    # what the Pause button does, mid-shard
        return real(self, name, have, size)

    monkeypatch.setattr(D.PanelOut, "progress", pause_on_first_chunk)
    dest = tmp_path / "model"
    p = panel_for(qtbot, hub, dest, tmp_path)
    with qtbot.waitSignal(p.paused, timeout=TIMEOUT):
        p.start_btn.click()
    assert p.state == "paused" and p.start_btn.text() == "Resume"
    total = sum(len(d) for d in source.values())           # the bar covers every file
    names = [p.files.item(r, 0).text() for r in range(p.files.rowCount())]
    assert sorted(names) == sorted(source) and 0 < p.overall.value() < 1000
    assert abs(p.overall.value() - 1000 * (sum(len(source[n]) for n in shard_names(source)[:3])
                                           + sum(len(d) for n, d in source.items()
                                                 if n not in shard_names(source))
                                           + fired[0]) / total) <= 1
    assert not (dest / shard).exists()
    parts = list((dest / ".k3-download").glob(f"{shard}.*.incomplete"))
    assert len(parts) == 1 and parts[0].stat().st_size == fired[0] > 0
    p.close()
    monkeypatch.setattr(D.PanelOut, "progress", real)

    before = len(hub.requests)
    again = panel_for(qtbot, hub, dest, tmp_path)          # the app restarted
    res = run_to_end(qtbot, again)
    assert res["code"] == 0
    gets = [r for r in hub.requests[before:] if r["server"] == "cdn" and r["name"] == shard]
    assert [r["range"] for r in gets] == [f"bytes={fired[0]}-"]
    assert (dest / shard).read_bytes() == source[shard]


def test_corrupt_shard_is_named_and_refetched(qtbot, hub, source, tmp_path, no_keyring):
    shard = shard_names(source)[4]
    bad = bytearray(source[shard])
    bad[len(bad) // 2] ^= 0x01
    hub.files[shard] = bytes(bad)                  # served corrupt, published hash intact
    dest = tmp_path / "model"
    p = panel_for(qtbot, hub, dest, tmp_path)
    res = run_to_end(qtbot, p)
    assert res["code"] == 1 and res["bad"] == [shard]
    assert shard in p.status.text() and p.refetch_btn.isEnabled()
    hub.files[shard] = source[shard]               # the hub serves it right again
    with qtbot.waitSignal(p.finished, timeout=TIMEOUT) as blocker:
        p.refetch_btn.click()
    assert blocker.args[0]["code"] == 0
    assert (dest / shard).read_bytes() == source[shard]


def test_token_in_a_0600_file_without_keyring(tmp_path, no_keyring):
    where = D.save_token("hf_abc123", str(tmp_path / "cfg"))
    path = tmp_path / "cfg" / D.TOKEN_FILE
    assert where == str(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert D.load_token(str(tmp_path / "cfg")) == "hf_abc123"


def test_token_in_the_keyring_when_there_is_one(tmp_path, monkeypatch):
    store = {}

    class FakeKeyring:
        def set_password(self, s, u, p):
            store[(s, u)] = p

        def get_password(self, s, u):
            return store.get((s, u))

    monkeypatch.setattr(D, "_keyring", lambda: FakeKeyring())
    assert D.save_token("hf_xyz", str(tmp_path / "cfg")) == "keyring"
    assert store[(D.KEYRING_SERVICE, D.KEYRING_USER)] == "hf_xyz"
    assert not (tmp_path / "cfg" / D.TOKEN_FILE).exists()  # never also on disk
    assert D.load_token(str(tmp_path / "cfg")) == "hf_xyz"


def test_remember_button_clears_the_field(qtbot, hub, tmp_path, no_keyring):
    p = panel_for(qtbot, hub, tmp_path / "m", tmp_path)
    p.remember.click()
    assert p.token.text() == "" and "only you can read" in p.token_note.text()
    assert D.load_token(str(tmp_path / "config")) == TOKEN


def test_window_tab_hands_the_download_to_setup(qtbot, window, hub, source, tmp_path,
                                                no_keyring):
    p = window.download
    assert window.tabs.indexOf(p) >= 0
    dest = tmp_path / "dl"
    p.repo.setText(hub.repo)
    p.endpoint.setText(hub.endpoint)
    p.dest.setText(str(dest))
    p.token.setText(TOKEN)
    res = run_to_end(qtbot, p)
    assert res["code"] == 0
    assert window.tabs.currentWidget() is window.setup
    assert window.setup.model.edit.text() == str(dest)


def test_setup_recognises_a_partial_download_and_resumes_it(qtbot, window, hub, source,
                                                            tmp_path, no_keyring,
                                                            monkeypatch):
    """A download paused in its fourth shard: the Setup picker says "partial download: 3 of
    14 shards", not the engine's missing-shard refusal, and offers to resume it; Resume
    download continues in the Download tab from the byte it reached."""
    import shutil

    from k3studio import checks

    shards = shard_names(source)
    shard = shards[3]
    fired = []
    real = D.PanelOut.progress

    def pause_in_the_fourth_shard(self, name, have, size):
        if name == shard and not fired:
            fired.append(have)
            self.pause.set()                      # what the Pause button does
        return real(self, name, have, size)

    monkeypatch.setattr(D.PanelOut, "progress", pause_in_the_fourth_shard)
    p = window.download
    dest = tmp_path / "dl"
    p.repo.setText(hub.repo)
    p.endpoint.setText(hub.endpoint)
    p.dest.setText(str(dest))
    with qtbot.waitSignal(p.paused, timeout=TIMEOUT):
        p.start_btn.click()
    monkeypatch.setattr(D.PanelOut, "progress", real)
    assert [n for n in shards if (dest / n).is_file()] == shards[:3]

    setup = window.setup
    window.tabs.setCurrentWidget(setup)
    setup.set_paths(str(dest), "", "")
    qtbot.waitUntil(lambda: setup.inspection is not None and not setup.validating,
                    timeout=TIMEOUT)
    text = setup.model.check.text()
    print(f"[app] partial download check: {text!r}")
    assert f"partial download: 3 of {len(shards)} shards, 1 part-way;" in text
    assert "resume it in Download" in text and "Download tab" in text
    assert "is missing" not in text                     # not the engine's shard refusal
    assert setup.resume_btn.isVisibleTo(setup) and not setup.load_btn.isEnabled()
    # the same folder without the downloader's state: the engine's generic refusal
    bare = tmp_path / "bare"
    shutil.copytree(dest, bare, ignore=shutil.ignore_patterns(".k3-download"))
    generic = checks.inspect(str(bare)).model.message
    assert "is missing" in generic and "partial download: 3" not in generic

    before = len(hub.requests)
    with qtbot.waitSignal(p.finished, timeout=TIMEOUT) as blocker:
        setup.resume_btn.click()
        assert window.tabs.currentWidget() is p           # resumed in the Download tab
    assert blocker.args[0]["code"] == 0
    fetched = [r for r in hub.requests[before:] if r["server"] == "cdn"]
    assert not [r for r in fetched if r["name"] in shards[:3]]           # kept, not refetched
    assert [r["range"] for r in fetched if r["name"] == shard] == [f"bytes={fired[0]}-"]
    assert (dest / shard).read_bytes() == source[shard]
    qtbot.waitUntil(lambda: not setup.validating and setup.inspection.model.ok,
                    timeout=TIMEOUT)
    assert window.tabs.currentWidget() is setup
    assert not setup.resume_btn.isVisibleTo(setup)
