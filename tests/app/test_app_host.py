"""The chat pane's one interface (chat_host.ChatHost): this machine's engine host and the
remote host both implement every request and signal, with the same signatures."""
from __future__ import annotations

import inspect

from k3studio.chat_host import REQUESTS, ChatHost, lacks
from k3studio.remote_host import RemoteHost
from k3studio.worker import EngineHost


def test_both_hosts_implement_the_chat_host_interface():
    for host in (EngineHost, RemoteHost):
        assert lacks(host) == [], host.__name__
        for name in REQUESTS:
            want = list(inspect.signature(getattr(ChatHost, name)).parameters)
            got = list(inspect.signature(getattr(host, name)).parameters)
            assert got == want, (host.__name__, name, got, want)
    print(f"[gate] EngineHost and RemoteHost: {len(REQUESTS)} requests with ChatHost's "
          f"signatures, every signal present")


def test_lacks_names_what_is_missing():
    class Half:
        send = stop = None
    assert "turnFinished" in lacks(Half) and "send" not in lacks(Half)
