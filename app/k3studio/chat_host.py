"""The one interface the chat pane talks to, whichever engine answers: this machine's
(worker.EngineHost, the engine on its QThread) or a remote endpoint (remote_host.RemoteHost).
chat_backend.ChatBackend relays the active one.  Declared once, so a host that lacks a
request or a signal fails tests/app/test_app_chat.py instead of a click doing nothing."""
from __future__ import annotations

from typing import Protocol, runtime_checkable

# what a host emits (Qt signals), in the plain values the panels read
SIGNALS = ("busyChanged", "conversation", "turnStarted", "records", "prefillProgress",
           "turnFinished", "pendingChanged")
# what the chat pane asks of it
REQUESTS = ("send", "edit", "continue_reply", "regenerate", "stop", "take_back",
            "new_conversation", "open_conversation", "save_conversation", "set_system",
            "refresh_conversation")


@runtime_checkable
class ChatHost(Protocol):
    busy: bool                        # a turn is running
    pending: dict | None              # the incomplete last reply (Conversation.pending)

    def send(self, text: str, spec) -> None: ...
    def edit(self, index: int, text: str, spec) -> None: ...
    def continue_reply(self, spec) -> None: ...
    def regenerate(self, spec) -> None: ...
    def stop(self) -> None: ...
    def take_back(self) -> None: ...
    def new_conversation(self, system_prompt: str = "") -> None: ...
    def open_conversation(self, path: str, extra: dict | None = None) -> None: ...
    def save_conversation(self, path: str) -> None: ...
    def set_system(self, text: str) -> None: ...
    def refresh_conversation(self) -> None: ...


def lacks(host_class) -> list[str]:
    """The signals and requests of the interface that `host_class` does not have."""
    return [n for n in SIGNALS + REQUESTS if not hasattr(host_class, n)]
