"""K3 Studio against a remote OpenAI-compatible endpoint: a real `k3 serve` process on
loopback plays the remote.  A streamed turn with the thinking shown apart, Stop (the
server's generation is cancelled), an unreachable URL shown as a clear error while the app
stays usable, and the API key kept out of the settings file."""
from __future__ import annotations

import os
import stat

import pytest

from .app_helpers import TIMEOUT

from serve_helpers import make_demo, serve  # noqa: E402 (tests/ is on the path)

KEY = "remote-test-key-93"
GEN = 256


@pytest.fixture(scope="module")
def remote_model(tmp_path_factory):
    return make_demo(str(tmp_path_factory.mktemp("remote") / "served"))


@pytest.fixture(scope="module")
def server(remote_model):
    with serve(remote_model, "--api-key", KEY, "--gen", str(GEN)) as s:
        yield s


@pytest.fixture(autouse=True)
def file_key_store(monkeypatch):
    monkeypatch.setenv("K3STUDIO_KEY_STORE", "file")     # no keyring daemon offscreen


def connect(qtbot, win, url: str, key: str) -> None:
    p = win.backend_panel
    p.remote.setChecked(True)
    p.url.setText(url)
    p.key.setText(key)
    p.connect_btn.click()


def remote_send(qtbot, win, text: str, started=None) -> dict:
    win.chat.input.setPlainText(text)
    qtbot.waitUntil(lambda: win.chat.send_btn.isEnabled(), timeout=TIMEOUT)
    with qtbot.waitSignal(win.backend.turnFinished, timeout=TIMEOUT) as blocker:
        win.chat.send_btn.click()
        if started is not None:
            started()
    return blocker.args[0]


def test_remote_turn_streams_thinking_apart_and_stop_cancels(qtbot, window, server, store,
                                                            tmp_path):
    connect(qtbot, window, server.base_url, KEY)
    qtbot.waitUntil(lambda: window.backend.is_remote and window.chat.loaded, timeout=TIMEOUT)
    assert window.backend_panel.model.currentText() == "served"
    assert "local-only" in window.chat.model_label.text()
    assert "local-only" in window.plots.summary.text()
    # the key is in the 0600 key file, not in the settings store
    window.save_settings()
    assert KEY not in open(store.fileName()).read()
    key_file = window.backend_panel.keys.path
    assert stat.S_IMODE(os.stat(key_file).st_mode) == 0o600 and KEY in open(key_file).read()

    records = []
    window.backend.records.connect(lambda r: records.extend(r))
    t = remote_send(qtbot, window, "Hello there")     # settings: thinking on, limit 12
    assert not t["failed"] and t["remote"] and t["n"] == window.settings.gen
    assert t["finish"] == "length" and t["first_token_seconds"] > 0
    phases = {r["phase"] for r in records}
    assert phases == {"thinking"}                     # random weights: still thinking
    pending = window.chat.pending                     # shown as an incomplete reply
    assert pending is not None and pending["why"] == "limit" and not pending["continuable"]
    assert pending["reasoning"] and len(pending["ids"]) == window.settings.gen
    assert "".join(r["text_delta"] for r in records) == pending["reasoning"]
    stats = window.chat.pending_stats
    assert "tokens/s" in stats and "local-only" in stats
    assert server.health()["last"]["completion_tokens"] == window.settings.gen

    # Stop mid-stream: the client closes the connection, the server cancels at a safe point
    window.chat.limit.setValue(GEN)
    seen = []
    window.backend.records.connect(lambda r: seen.extend(r))

    def stop_after_first_piece():
        qtbot.waitUntil(lambda: len(seen) >= 2, timeout=TIMEOUT)
        window.chat.stop_btn.click()
    t2 = remote_send(qtbot, window, "Go on, at length", stop_after_first_piece)
    assert t2["interrupted"] and t2["finish"] == "cancelled"
    h = server.wait_idle()
    assert h["last"]["finish_reason"] == "cancelled"
    assert h["last"]["completion_tokens"] < GEN
    assert window.chat.pending["why"] == "stopped"
    # the app is usable afterwards: the next turn runs
    window.chat.limit.setValue(4)
    t3 = remote_send(qtbot, window, "Short one")
    assert not t3["failed"] and t3["n"] == 4


def test_unreachable_url_is_a_clear_error_and_the_app_stays_usable(qtbot, window, server):
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()                                          # nothing listens there now
    connect(qtbot, window, f"http://127.0.0.1:{port}/v1", "")
    state = window.backend_panel.state
    qtbot.waitUntil(lambda: "Not connected" in state.text(), timeout=TIMEOUT)
    assert f"cannot reach http://127.0.0.1:{port}/v1" in state.text()
    assert not window.backend.is_remote and not window.chat.loaded
    connect(qtbot, window, "not a url", "")
    assert "is not an http(s) URL" in state.text()
    # still usable: the same panel connects to a real endpoint and a turn runs
    connect(qtbot, window, server.base_url, KEY)
    qtbot.waitUntil(lambda: window.backend.is_remote and window.chat.loaded, timeout=TIMEOUT)
    window.chat.limit.setValue(3)
    t = remote_send(qtbot, window, "Hi")
    assert not t["failed"] and t["n"] == 3
    # and a wrong key is an error in the banner, the conversation kept
    window.remote.api_key = "wrong"
    t = remote_send(qtbot, window, "Again")
    assert t["failed"] and window.last_error and "401" in window.last_error["message"]
    assert window.remote.messages[-1]["content"] == "Again"


def test_switching_back_to_this_machine(qtbot, window, server):
    connect(qtbot, window, server.base_url, KEY)
    qtbot.waitUntil(lambda: window.backend.is_remote, timeout=TIMEOUT)
    window.backend_panel.local.setChecked(True)
    assert not window.backend.is_remote and window.backend.active is window.host
    assert not window.chat.loaded                      # no local model was loaded
    assert window.settings.backend == "local" and window.settings.remote_url


def test_the_app_starts_and_stops_its_local_server(qtbot, window, demo_model):
    """The Setup toggle runs `k3 serve` on the current model, with the Memory tab's
    settings (S3-FIFO replacement here: serve takes every flag the app passes) and a prompt
    cache in the data folder; the URL it shows answers."""
    import json
    import urllib.request
    window.setup.set_paths(*demo_model)
    window.memory.policy.setCurrentIndex(window.memory.policy.findData("s3fifo"))
    qtbot.waitUntil(lambda: window.spec().model_dir == demo_model[0], timeout=TIMEOUT)
    assert window.spec().cache_policy == "s3fifo"
    p = window.backend_panel
    p.serve.setChecked(True)
    qtbot.waitUntil(lambda: p.serve_url.text().startswith("http://127.0.0.1:"),
                    timeout=TIMEOUT)
    url = p.serve_url.text()
    with urllib.request.urlopen(url.removesuffix("/v1") + "/health", timeout=30) as r:
        h = json.loads(r.read())
    assert h["status"] == "ok" and h["model"] == os.path.basename(demo_model[0])
    # its prompt cache lives in the app's data folder (kept across a restart)
    args = window.local_server.proc.arguments()
    cache_dir = args[args.index("--prompt-cache-dir") + 1]
    assert cache_dir == os.path.join(window.data_dir, "prompt-cache") and os.path.isdir(cache_dir)
    with qtbot.waitSignal(window.local_server.stopped, timeout=TIMEOUT) as blocker:
        p.serve.setChecked(False)
    assert blocker.args[0] == 0 and not window.local_server.running
    assert not p.serve.isChecked()
    # on again: the same URL (another app configured with it keeps working), and the port
    # is kept in the settings for the next start of the app
    p.serve.setChecked(True)
    qtbot.waitUntil(lambda: p.serve_url.text().startswith("http://127.0.0.1:"),
                    timeout=TIMEOUT)
    assert p.serve_url.text() == url
    window.save_settings()
    assert window.settings.serve_port == int(url.split(":")[2].split("/")[0])
    with qtbot.waitSignal(window.local_server.stopped, timeout=TIMEOUT):
        p.serve.setChecked(False)


def test_remote_regenerate_and_conversation_files(qtbot, window, server, tmp_path):
    """Regenerate answers the same message again (greedy: the same reply), and the
    conversation saves and opens as the engine's JSONL history."""
    from k3engine.chat import History
    connect(qtbot, window, server.base_url, KEY)
    qtbot.waitUntil(lambda: window.backend.is_remote and window.chat.loaded, timeout=TIMEOUT)
    window.chat.limit.setValue(5)
    first = remote_send(qtbot, window, "Name a colour")
    reply = window.chat.pending["reasoning"]
    qtbot.waitUntil(lambda: window.chat.regen_btn.isEnabled(), timeout=TIMEOUT)
    with qtbot.waitSignal(window.backend.turnFinished, timeout=TIMEOUT) as blocker:
        window.chat.regen_btn.click()
    again = blocker.args[0]
    assert not first["failed"] and not again["failed"] and again["n"] == first["n"] == 5
    assert window.chat.pending["reasoning"] == reply         # greedy on the server
    path = tmp_path / "remote.jsonl"
    window.chat.host.save_conversation(str(path))
    saved = History.load(path)
    assert [m.role for m in saved] == ["user"] and saved[-1].content == "Name a colour"
    window.chat.host.new_conversation("")
    qtbot.waitUntil(lambda: not window.remote.messages, timeout=TIMEOUT)
    window.chat.open_conversation(str(path))
    qtbot.waitUntil(lambda: window.remote.messages and
                    window.remote.messages[-1]["content"] == "Name a colour", timeout=TIMEOUT)


def test_an_incomplete_remote_reply_is_answered_as_it_is(qtbot, window, server):
    connect(qtbot, window, server.base_url, KEY)
    qtbot.waitUntil(lambda: window.backend.is_remote and window.chat.loaded, timeout=TIMEOUT)
    window.chat.limit.setValue(3)
    remote_send(qtbot, window, "First")
    cut = window.chat.pending
    t = remote_send(qtbot, window, "Second")
    assert not t["failed"]
    roles = [(m["role"], m["incomplete"]) for m in window.remote.messages]
    assert roles == [("user", False), ("assistant", True), ("user", False)]
    assert window.remote.messages[1]["reasoning"] == cut["reasoning"]
    # the server saw it: the second prompt extends the first (reply sent back as generated)
    assert server.health()["last"]["reused_positions"] > 0


def test_remote_chats_are_saved_and_listed_with_their_endpoint(qtbot, window, server):
    """A conversation with a remote endpoint is saved and listed like a local one, its
    endpoint and model in the meta file; back on this machine the library is on the local
    conversation again."""
    connect(qtbot, window, server.base_url, KEY)
    qtbot.waitUntil(lambda: window.backend.is_remote and window.chat.loaded, timeout=TIMEOUT)
    window.chat.limit.setValue(5)
    remote_send(qtbot, window, "Name a colour")
    qtbot.waitUntil(lambda: window.library.current is not None, timeout=TIMEOUT)
    cid = window.library.current
    meta = window.library.store.load(cid)[1]
    print(f"[app] remote conversation {cid}: backend {meta.extra.get('backend')}")
    assert meta.extra["backend"]["kind"] == "remote"
    assert meta.extra["backend"]["url"] == server.base_url
    assert cid in [m.id for m in window.library.store.list()]
    window.backend_panel.local.setChecked(True)
    qtbot.waitUntil(lambda: not window.backend.is_remote, timeout=TIMEOUT)
    assert window.library.current != cid
