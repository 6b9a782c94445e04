"""Settings: one typed object, persisted with QSettings, restored at start, migrated."""
from __future__ import annotations

from dataclasses import asdict, fields

from PySide6.QtCore import QSettings

from k3studio import settings as S


def test_round_trip_every_field(tmp_path):
    store = QSettings(str(tmp_path / "s.ini"), QSettings.IniFormat)
    s = S.StudioSettings(model_dir="/m", trunk_dir="/t", tok_dir="/k", demo_offered=True,
                         preset="custom", trunk_gb=12.5, cache_gb=0.75, trunk_ring=3,
                         cache_policy="s3fifo", lookahead=False, threads=4, gen=999, thinking=False, effort="max",
                         system_prompt="Be brief.\nReally.", greedy=False, temperature=0.7,
                         top_p=0.9, top_k=40, seed=1234, conversation_path="/c.jsonl",
                         geometry=b"\x01\x00\xffgeo", splitter=b"\x00split", tab=2)
    S.save(store, s)
    back = S.load(QSettings(str(tmp_path / "s.ini"), QSettings.IniFormat))
    assert asdict(back) == asdict(s)
    assert {f.name for f in fields(S.StudioSettings)} >= {"version"}
    assert back.version == S.SETTINGS_VERSION


def test_missing_store_gives_defaults(tmp_path):
    back = S.load(QSettings(str(tmp_path / "none.ini"), QSettings.IniFormat))
    assert asdict(back) == asdict(S.StudioSettings())


def test_migration_from_version_1(tmp_path):
    store = QSettings(str(tmp_path / "v1.ini"), QSettings.IniFormat)
    store.setValue("version", 1)
    store.setValue("expert_cache_gb", 7.5)
    store.setValue("effort_level", "high")
    store.setValue("model_dir", "/old/model")
    store.sync()
    back = S.load(store)
    assert back.cache_gb == 7.5 and back.effort == "high" and back.model_dir == "/old/model"
    assert back.version == S.SETTINGS_VERSION


def test_a_damaged_value_falls_back_to_its_default_only(tmp_path):
    store = QSettings(str(tmp_path / "bad.ini"), QSettings.IniFormat)
    store.setValue("version", S.SETTINGS_VERSION)
    store.setValue("trunk_gb", "lots")
    store.setValue("gen", "12")
    store.sync()
    back = S.load(store)
    assert back.trunk_gb == S.StudioSettings().trunk_gb
    assert back.gen == 12


def test_window_restores_what_it_saved(qtbot, tmp_path, demo_model):
    from k3studio.window import TAB_MEMORY, MainWindow
    path = str(tmp_path / "w.ini")
    win = MainWindow(store=QSettings(path, QSettings.IniFormat), data_dir=str(tmp_path))
    qtbot.addWidget(win)
    win.setup.set_paths(*demo_model)
    win.memory.ring.setValue(3)
    win.memory.policy.setCurrentIndex(win.memory.policy.findData("s3fifo"))
    win.memory.lookahead.setChecked(False)
    win.chat.limit.setValue(77)
    win.chat.thinking.setChecked(False)
    win.tabs.setCurrentIndex(TAB_MEMORY)
    win.close()
    again = MainWindow(store=QSettings(path, QSettings.IniFormat), data_dir=str(tmp_path))
    qtbot.addWidget(again)
    s = again.settings
    assert (s.model_dir, s.trunk_dir) == demo_model
    assert s.trunk_ring == 3 and s.gen == 77 and s.thinking is False
    assert s.cache_policy == "s3fifo" and again.memory.policy.currentData() == "s3fifo"
    assert again.spec().load_spec().cache_policy == "s3fifo"
    assert "--cache-policy s3fifo" in again.chat.command.text()   # the k3 line to reproduce
    assert s.lookahead is False and not again.memory.lookahead.isChecked()
    assert again.spec().load_spec().lookahead is False
    assert "--no-lookahead" in again.chat.command.text()
    assert again.memory.ring.value() == 3 and again.chat.limit.value() == 77
    assert again.setup.model.text() == demo_model[0]
    assert again.tabs.currentIndex() == TAB_MEMORY
    again.close()


def test_settings_file_is_private(tmp_path):
    """The settings hold the system prompt: the file is 0600 after a save (issue 14)."""
    import stat
    from PySide6.QtCore import QSettings
    from k3studio import settings as S
    store = QSettings(str(tmp_path / "k3.ini"), QSettings.IniFormat)
    S.save(store, S.replace(S.StudioSettings(), system_prompt="private words"))
    mode = stat.S_IMODE((tmp_path / "k3.ini").stat().st_mode)
    print(f"[gate] settings file mode {oct(mode)}")
    assert mode == 0o600
