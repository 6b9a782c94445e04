"""Issue 47: the app starts whatever is in its data folder, and writes nothing through a
link planted there.

Each finding of the issue has a test here: a damaged conversation, meta, settings or key
file is moved aside into `damaged/` (never deleted), the window says so once naming the
file, everything else loads; settings values are clamped; the app's files are created with
their final mode.  Cases that hung the old code (a FIFO, version=-99999999999) run in a
thread with a deadline, so a regression fails instead of hanging the suite.
"""
from __future__ import annotations

import json
import os
import stat
import threading

import pytest
from PySide6.QtCore import QSettings

from k3engine.chat import History, Message
from k3studio import damaged
from k3studio import settings as S
from k3studio.conversations import ConversationStore, Meta
from k3studio.secrets_store import KeyStore

DEADLINE = 20.0          # seconds; the fixed code takes milliseconds


@pytest.fixture(autouse=True)
def no_leftover_notices():
    damaged.take_notices()
    yield
    damaged.take_notices()


def finishes(fn, seconds: float = DEADLINE):
    """fn()'s result, or a test failure when it has not returned within `seconds` (the
    thread is a daemon: a hang of the old code ends with the test process)."""
    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:      # noqa: BLE001 - re-raised below
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"still running after {seconds} s (hangs)"
    if "error" in out:
        raise out["error"]
    return out.get("value")


def _good(root, cid="20260101-000000-aaaaaa", text="hello good world"):
    store = ConversationStore(str(root))
    store.save(cid, History([Message("user", text), Message("assistant", "hi")]),
               Meta(cid, title="Good one"))
    return cid


def _moved(folder, name) -> list[str]:
    d = folder / "damaged"
    return sorted(p.name for p in d.iterdir() if p.name.startswith(name)) if d.is_dir() else []


BAD_META = {
    "deep": lambda p: p.write_text("[" * 1000),
    "zero": lambda p: p.symlink_to("/dev/zero"),
    "fifo": lambda p: os.mkfifo(p),
    "surrogate": lambda p: p.write_text('{"title": "bad \\ud800 title"}'),
    "array": lambda p: p.write_text("[1, 2]"),
}


@pytest.mark.parametrize("kind", sorted(BAD_META))
def test_a_damaged_meta_is_moved_aside_and_the_rest_loads(tmp_path, kind):
    root = tmp_path / "conversations"
    good = _good(root)
    bad = "20260102-000000-bbbbbb"
    History([Message("user", "second")]).save(root / f"{bad}.jsonl")
    BAD_META[kind](root / f"{bad}.meta.json")
    metas = finishes(lambda: ConversationStore(str(root)).list())
    assert {m.id for m in metas} == {good, bad}
    assert [m.title for m in metas if m.id == bad] == ["second"]
    assert len(_moved(root, f"{bad}.meta.json")) == 1
    notes = damaged.take_notices()
    assert len(notes) == 1 and f"{bad}.meta.json" in notes[0] and "moved to" in notes[0]
    # and the conversation saves again (a lone surrogate used to fail every later save)
    store = ConversationStore(str(root))
    history, meta = store.load(bad)
    store.save(bad, history, meta)
    assert json.loads((root / f"{bad}.meta.json").read_text())["title"] == "second"


def test_the_window_starts_with_damaged_files_and_says_so_once(qtbot, tmp_path):
    """A real start: a deep meta, a damaged transcript and a damaged key file in the data
    folder; the good conversation is listed and one notice per file names it."""
    from k3studio.window import MainWindow
    data = tmp_path / "data"
    root = data / "conversations"
    good = _good(root)
    (root / "20260103-000000-cccccc.jsonl").write_text('{"role": "user", "content": "x"}\n'
                                                      '{"role": "nobody"}\n')
    (root / "20260104-000000-dddddd.jsonl").write_text('{"role": "user", "content": "y"}\n')
    (root / "20260104-000000-dddddd.meta.json").write_text("[" * 1000)
    (data / "remote_keys.json").write_text('{"https://a": "k1", ')
    store = QSettings(str(tmp_path / "s.ini"), QSettings.IniFormat)
    store.setValue("remote_url", "https://a")        # the Setup tab reads its key at start
    os.environ["K3STUDIO_KEY_STORE"] = "file"
    try:
        win = MainWindow(store=store, data_dir=str(data))
        qtbot.addWidget(win)
    finally:
        os.environ.pop("K3STUDIO_KEY_STORE", None)
    titles = win.sidebar.titles()
    assert "Good one" in titles and "y" in titles and len(titles) == 2
    notes = win.sidebar.damage_notes
    for name in ("20260103-000000-cccccc.jsonl", "20260104-000000-dddddd.meta.json",
                 "remote_keys.json"):
        assert sum(name in n for n in notes) == 1, notes
    assert win.sidebar.damage_bar.isVisibleTo(win.sidebar)
    assert _moved(root, "20260103-000000-cccccc.jsonl") and _moved(data, "remote_keys.json")
    assert good in {m.id for m in win.sidebar.store.list()}
    win.sidebar.refresh()                            # said once: no second notice
    assert len(win.sidebar.damage_notes) == len(notes)
    win.close()


def test_a_json_line_that_is_not_an_object_does_not_blank_the_sidebar(qtbot, tmp_path):
    from k3studio.conversations_panel import ConversationsPanel
    root = tmp_path / "conversations"
    _good(root)
    odd = "20260105-000000-eeeeee"
    (root / f"{odd}.jsonl").write_text('{"role": "user", "content": "hello there"}\n[1]\n')
    (root / f"{odd}.meta.json").write_text('{"title": "Odd one"}')
    panel = ConversationsPanel(ConversationStore(str(root)))
    qtbot.addWidget(panel)
    panel.search.setText("hello")
    assert sorted(panel.titles()) == ["Good one", "Odd one"]     # both say "hello"


@pytest.mark.parametrize("marks", [5, "ab", [[1]], [None], {"a": 1}])
def test_badly_typed_incomplete_messages_do_not_crash_markdown_export(tmp_path, marks):
    root = tmp_path / "conversations"
    cid = _good(root)
    meta = json.loads((root / f"{cid}.meta.json").read_text())
    meta["extra"] = {"incomplete_messages": marks}
    meta["incomplete"] = {"content": 7, "reasoning": ["x"], "why": "stopped"}
    (root / f"{cid}.meta.json").write_text(json.dumps(meta))
    store = ConversationStore(str(root))
    store.export_markdown(cid, str(tmp_path / "out.md"))
    text = (tmp_path / "out.md").read_text()
    assert "hello good world" in text and "(incomplete" not in text


def test_a_lone_surrogate_from_the_engine_is_saved_not_fatal(tmp_path):
    root = tmp_path / "conversations"
    cid = _good(root)
    store = ConversationStore(str(root))
    history, meta = store.load(cid)
    meta.incomplete = {"content": "cut \ud800 here", "why": "stopped"}
    store.save(cid, history, meta)
    store.save(cid, history, store.meta(cid))
    assert store.meta(cid).incomplete["content"] == "cut ? here"


@pytest.mark.parametrize("content", ['{"https://a": "k1", ', '["k1"]',
                                     '{"https://a": "k1", "https://b": {"x": 1}}'])
def test_a_damaged_key_file_is_kept_not_replaced(tmp_path, monkeypatch, content):
    monkeypatch.setenv("K3STUDIO_KEY_STORE", "file")
    (tmp_path / "remote_keys.json").write_text(content)
    ks = KeyStore(str(tmp_path))
    ks.set("https://new", "k2")
    moved = _moved(tmp_path, "remote_keys.json")
    assert len(moved) == 1
    assert (tmp_path / "damaged" / moved[0]).read_text() == content     # every key kept
    assert ks.get("https://new") == "k2"
    if content.endswith("}}"):                       # the good neighbour stays usable
        assert ks.get("https://a") == "k1"
    assert len(damaged.take_notices()) == 1


# --- settings -------------------------------------------------------------------------

@pytest.mark.parametrize("key,value,field,want", [
    ("threads", "inf", "threads", 0), ("trunk_gb", "nan", "trunk_gb", 3.0),
    ("gen", "12345678901234567890", "gen", 4096), ("version", "-99999999999", "gen", 256),
    ("top_p", "7", "top_p", 1.0), ("effort", "ultra", "effort", "low")])
def test_settings_values_are_validated_and_clamped(tmp_path, caplog, key, value, field, want):
    path = str(tmp_path / "s.ini")
    store = QSettings(path, QSettings.IniFormat)
    store.setValue(key, value)
    store.sync()
    got = finishes(lambda: S.load(QSettings(path, QSettings.IniFormat)))
    assert getattr(got, field) == want
    assert any(key in r.getMessage() for r in caplog.records), "the reason is logged"


def test_the_window_starts_on_hostile_settings(qtbot, tmp_path):
    from k3studio.window import MainWindow
    path = str(tmp_path / "s.ini")
    store = QSettings(path, QSettings.IniFormat)
    for k, v in dict(threads="inf", trunk_gb="nan", cache_gb="-1e400", gen="9" * 20,
                     seed="9" * 20, tab="-3").items():
        store.setValue(k, v)
    store.sync()
    win = MainWindow(store=QSettings(path, QSettings.IniFormat), data_dir=str(tmp_path / "d"))
    qtbot.addWidget(win)
    assert win.settings.gen == 4096 and win.settings.threads == 0
    win.close()


@pytest.fixture
def user_settings_dir(tmp_path):
    """QSettings' per-user INI folder pointed at tmp_path (restored after)."""
    from k3studio import APP_NAME, ORG_NAME
    probe = QSettings(QSettings.IniFormat, QSettings.UserScope, ORG_NAME, APP_NAME)
    was = os.path.dirname(os.path.dirname(probe.fileName()))
    del probe
    QSettings.setPath(QSettings.IniFormat, QSettings.UserScope, str(tmp_path))
    yield tmp_path / ORG_NAME, APP_NAME + ".ini"
    QSettings.setPath(QSettings.IniFormat, QSettings.UserScope, was)


@pytest.mark.parametrize("kind", ["fifo", "zero", "victim"])
def test_a_settings_file_that_is_no_file_is_moved_aside(user_settings_dir, tmp_path, kind):
    folder, name = user_settings_dir
    folder.mkdir(parents=True)
    victim = tmp_path / "victim"
    victim.write_text("[General]\ngen=7\n")
    {"fifo": lambda p: os.mkfifo(p), "zero": lambda p: p.symlink_to("/dev/zero"),
     "victim": lambda p: p.symlink_to(victim)}[kind](folder / name)
    store = finishes(S.default_store)
    s = S.load(store)
    assert s.gen == 256                              # defaults: nothing read through it
    S.save(store, S.replace(s, system_prompt="private"))
    assert victim.read_text() == "[General]\ngen=7\n"
    assert _moved(folder, name) and (folder / name).is_file()
    assert not (folder / name).is_symlink()
    assert stat.S_IMODE((folder / name).stat().st_mode) == 0o600
    assert len(damaged.take_notices()) == 1


def test_the_settings_file_is_0600_before_qsettings_writes_it(tmp_path):
    """Issue 47, finding 4: the file was written with the umask's mode, then narrowed."""
    path = tmp_path / "k3.ini"
    store = QSettings(str(path), QSettings.IniFormat)
    seen = []
    real_sync = store.sync
    store.sync = lambda: (seen.append(stat.S_IMODE(os.stat(path).st_mode)
                                      if path.exists() else None), real_sync())
    old = os.umask(0o022)
    try:
        S.save(store, S.StudioSettings())
    finally:
        os.umask(old)
    assert seen == [0o600]
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_an_existing_conversations_folder_is_narrowed(tmp_path):
    root = tmp_path / "conversations"
    root.mkdir(mode=0o755)
    os.chmod(root, 0o755)
    ConversationStore(str(root))
    assert stat.S_IMODE(root.stat().st_mode) == 0o700


# --- links planted in the app's folders (file and folder variants) ----------------------

@pytest.fixture
def victim(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    v = outside / "victim"
    v.write_text("precious\n")
    return v


def _untouched(victim) -> None:
    assert victim.read_text() == "precious\n"
    assert sorted(p.name for p in victim.parent.iterdir()) == ["victim"]


@pytest.mark.parametrize("which", ["jsonl", "meta.json"])
def test_a_conversation_save_never_writes_through_a_link(tmp_path, victim, which):
    root = tmp_path / "conversations"
    cid = _good(root)
    store = ConversationStore(str(root))
    history, meta = store.load(cid)
    p = root / f"{cid}.{which}"
    p.unlink()
    p.symlink_to(victim)
    with pytest.raises(OSError, match="symbolic link"):
        store.save(cid, history, meta)
    _untouched(victim)


def test_delete_never_moves_a_conversation_through_a_trash_link(tmp_path, victim):
    root = tmp_path / "conversations"
    cid = _good(root)
    (root / ".trash").symlink_to(victim.parent, target_is_directory=True)
    store = ConversationStore(str(root))
    store.delete(cid)
    _untouched(victim)
    assert (root / ".trash" / f"{cid}.jsonl").is_file() and _moved(root, ".trash")
    assert store.undo_delete(cid) and (root / f"{cid}.jsonl").is_file()


def test_move_aside_never_follows_a_damaged_folder_link(tmp_path, victim):
    root = tmp_path / "conversations"
    _good(root)
    (root / "damaged").symlink_to(victim.parent, target_is_directory=True)
    (root / "x.meta.json").write_text("[")
    assert damaged.move_aside(str(root / "x.meta.json"), "test") is None
    _untouched(victim)
    assert "could not be moved aside" in damaged.take_notices()[0]


@pytest.mark.parametrize("variant", ["file", "temp"])
def test_the_key_and_token_files_never_write_through_a_link(tmp_path, victim, monkeypatch,
                                                            variant):
    from k3studio.download_panel import TOKEN_FILE, save_token
    monkeypatch.setenv("K3STUDIO_KEY_STORE", "file")
    monkeypatch.setattr("k3studio.download_panel._keyring", lambda: None)
    if variant == "file":
        (tmp_path / "remote_keys.json").symlink_to(victim)
        (tmp_path / TOKEN_FILE).symlink_to(victim)
        KeyStore(str(tmp_path)).set("https://a", "secret")
        with pytest.raises(OSError, match="symbolic link"):
            save_token("hf_secret", str(tmp_path))
    else:                                            # the temp names a writer used
        (tmp_path / f"{TOKEN_FILE}.tmp").symlink_to(victim)
        (tmp_path / f".remote_keys.json.tmp-{os.getpid()}").symlink_to(victim)
        KeyStore(str(tmp_path)).set("https://a", "secret")
        save_token("hf_secret", str(tmp_path))
    _untouched(victim)


def test_opening_a_damaged_transcript_moves_it_aside_and_says_so(qtbot, tmp_path):
    from k3studio.window import MainWindow
    data = tmp_path / "data"
    root = data / "conversations"
    _good(root)
    bad = "20260106-000000-ffffff"
    (root / f"{bad}.jsonl").write_text('{"role": "assistant", "content": "no user"}\n')
    (root / f"{bad}.meta.json").write_text('{"title": "Listed by its title"}')
    win = MainWindow(store=QSettings(str(tmp_path / "s.ini"), QSettings.IniFormat),
                     data_dir=str(data))
    qtbot.addWidget(win)
    assert "Listed by its title" in win.sidebar.titles()    # the title came from the meta
    with qtbot.waitSignal(win.library.failed, timeout=5000) as said:
        assert not win.library.open(bad)
    why = said.args[0]
    assert why.count(str(root / f"{bad}.jsonl")) == 1 and "damaged folder" in why
    assert _moved(root, f"{bad}.jsonl") and _moved(root, f"{bad}.meta.json")
    assert any(f"{bad}.jsonl" in n for n in win.sidebar.damage_notes)
    win.sidebar.refresh()
    assert win.sidebar.titles() == ["Good one"]
    win.close()
