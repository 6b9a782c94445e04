"""Issue 47: no writer of the project writes through a symlink it did not create.

A link is planted where a writer puts a file (a temp name, a partial file, a manifest, a
file or folder of its own working folder) pointing at a victim outside; the write must
leave the victim's bytes as they were.  File variant: the link points at a file; directory
variant: a folder of the writer's own is a link to an outside folder.  The download's own
cases are in test_download.py (test_symlink_inside_the_part_dir_is_never_written_through),
the app's in tests/app/test_app_damaged.py.
"""
from __future__ import annotations

import errno
import os

import pytest

from k3engine.atomic import write_atomic
from k3engine.chat import History, Message


@pytest.fixture
def victim(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    v = outside / "victim"
    v.write_bytes(b"precious\n")
    return v


def _untouched(victim) -> None:
    assert victim.read_bytes() == b"precious\n"
    assert sorted(p.name for p in victim.parent.iterdir()) == ["victim"]


def test_a_history_save_never_follows_a_link_at_its_temp_name(tmp_path, victim):
    """write_atomic's temp `.NAME.tmp-PID` (histories, --out, state of the app, caches):
    opened O_CREAT|O_TRUNC before, so a link planted at the guessable name got the text."""
    path = tmp_path / "h.jsonl"
    (tmp_path / f".h.jsonl.tmp-{os.getpid()}").symlink_to(victim)
    History([Message("user", "secret words")]).save(path)
    _untouched(victim)
    assert History.load(path) == History([Message("user", "secret words")])
    assert not os.path.lexists(tmp_path / f".h.jsonl.tmp-{os.getpid()}")


@pytest.mark.parametrize("variant", ["file", "dir"])
def test_write_atomic_inside_its_folder_refuses_links(tmp_path, victim, variant):
    root = tmp_path / "own"
    root.mkdir()
    if variant == "file":
        target = root / "state.json"
        target.symlink_to(victim)
    else:
        (root / "sub").symlink_to(victim.parent, target_is_directory=True)
        target = root / "sub" / "victim"
    with pytest.raises(OSError) as e:
        write_atomic(target, b"pwned\n", inside=root)
    assert e.value.errno == errno.ELOOP and "symbolic link" in str(e.value)
    _untouched(victim)


def test_a_user_named_link_is_still_followed(tmp_path):
    """`--out LINK` names a link its user made: the save lands in its target (unchanged)."""
    real = tmp_path / "real.json"
    real.write_bytes(b"old\n")
    (tmp_path / "link.json").symlink_to(real)
    write_atomic(tmp_path / "link.json", b"new\n")
    assert real.read_bytes() == b"new\n" and (tmp_path / "link.json").is_symlink()


def test_open_nofollow_refuses_a_fifo_without_blocking(tmp_path):
    from k3engine.atomic import open_nofollow
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(OSError):
        open_nofollow(tmp_path / "fifo", os.O_WRONLY)


@pytest.mark.parametrize("which", ["trunk.bin", "trunk.json"])
def test_pack_trunk_never_follows_a_link_at_its_partial_names(tmp_path, victim, which):
    from k3engine.tools.make_checkpoint import dims_config, make_checkpoint
    from k3engine.trunk import pack_trunk
    model, trunk = tmp_path / "m", tmp_path / "t"
    make_checkpoint(str(model), dims_config("tiny"), seed=1)
    trunk.mkdir()
    (trunk / f"{which}.partial-{os.getpid()}").symlink_to(victim)
    m = pack_trunk(str(model), str(trunk), n_layers=2)
    _untouched(victim)
    assert len(m.layers) == 2
    assert sorted(p.name for p in trunk.iterdir()) == ["trunk.bin", "trunk.json"]


@pytest.mark.parametrize("variant", ["file", "dir"])
def test_the_machine_figures_cache_refuses_links(tmp_path, victim, monkeypatch, variant):
    from k3engine import calibrate, machine
    cache = tmp_path / "cache"
    cache.mkdir()
    if variant == "dir":
        (cache / "k3studio").symlink_to(victim.parent, target_is_directory=True)
        path = cache / "k3studio" / "victim"
    else:
        (cache / "k3studio").mkdir()
        path = cache / "k3studio" / machine.CACHE_NAME
        path.symlink_to(victim)
    monkeypatch.setattr(calibrate, "measure_machine", lambda d, nt, progress=None: _FakeFigures())
    calibrate.machine_figures(str(tmp_path), threads=1, refresh=True, path=str(path))
    _untouched(victim)


class _FakeFigures:
    identity = {"machine": "test"}

    def to_json(self) -> dict:
        return {"figures": 1}


def test_make_checkpoint_never_follows_a_link_at_its_temp_names(tmp_path, victim):
    from k3engine.tools.make_checkpoint import (TOKENIZER_FILES, dims_config, make_checkpoint,
                                                write_tokenizer)
    first, second = tmp_path / "a", tmp_path / "b"
    make_checkpoint(str(first), dims_config("tiny"), seed=1)
    second.mkdir()
    shards = [p.name for p in first.iterdir() if p.name.endswith(".safetensors")]
    for name in shards + list(TOKENIZER_FILES):
        (second / f"{name}.tmp-{os.getpid()}").symlink_to(victim)
    make_checkpoint(str(second), dims_config("tiny"), seed=1)
    assert write_tokenizer(str(second), 1 << 20)
    _untouched(victim)
    for name in shards:
        assert (second / name).read_bytes() == (first / name).read_bytes()


def test_the_history_lock_never_truncates_through_a_link(tmp_path, victim):
    """The lock sidecar `.NAME.lock` beside a history: a link planted at that name is
    refused (the lock used to open it and truncate what it pointed at)."""
    from k3engine.chat import ChatError, HistoryLock
    history = tmp_path / "h.jsonl"
    (tmp_path / ".h.jsonl.lock").symlink_to(victim)
    with pytest.raises(ChatError, match="cannot lock history"):
        HistoryLock(history)
    _untouched(victim)
