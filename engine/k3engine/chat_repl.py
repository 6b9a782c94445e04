"""`k3 <model> --chat`: the REPL of SYSTEM §9.4 over the run API, with the reference's
messages, history file handling and exit codes (§9.3, §9.6).

Two modes, told apart by whether stdin and stdout are both terminals:
* non-interactive (a pipe, a file, a script): the spec's lines exactly — `chat: token N/G`
  progress on stderr, `<think>`/`<response>` after the turn, and a turn that does not close
  within --gen ends the REPL with exit 1;
* interactive (a person at a terminal): the reply streams as it is generated (the thinking
  dimmed), a per-reply stats line follows, and a reply that reaches --gen or is stopped
  with Ctrl-C stays open: `/continue` goes on from where it stopped (the same ids as one
  uninterrupted turn), a new message replaces the unanswered one.
"""
from __future__ import annotations

import signal
import sys
import time

from .chat import (HELP_LINES, USER_PROMPT, ChatError, History, HistoryLock, Message,
                   apply_system)
from .console import Printer
from .errors import EXIT_DROP, EXIT_OK, EXIT_RUNTIME, EXIT_USAGE, EngineError
from .events import TokenOut, TurnEnded
from .experts import ExpertLoadError
from .run import Cancel, RunRequest, chat_controls, open_run
from .telemetry import Events


DIM, PLAIN = "\x1b[2m", "\x1b[0m"
CONTINUE = "/continue"


def _interactive() -> bool:
    return sys.stdin.isatty() and sys.stdout.isatty()


def _read_line() -> str | None:
    sys.stdout.write(USER_PROMPT)
    sys.stdout.flush()
    line = sys.stdin.readline()
    if not line:
        return None
    return line.rstrip("\r\n")


def chat_main(req: RunRequest, history_path: str | None, system: str | None,
              events: Events) -> int:
    try:
        # held for the whole session: a second chat on this history is refused, not raced
        lock = HistoryLock(history_path) if history_path else None
    except ChatError as e:
        print(f"chat: {e}", file=sys.stderr)
        return EXIT_USAGE
    try:
        return _chat(req, history_path, system, events)
    finally:
        if lock is not None:
            lock.release()


def _chat(req: RunRequest, history_path: str | None, system: str | None,
          events: Events) -> int:
    try:
        history = History.load(history_path) if history_path else History()
        if system is not None and apply_system(history, system) and history_path:
            history.save(history_path)
    except ChatError as e:
        print(f"chat: {e}", file=sys.stderr)
        return EXIT_USAGE
    from .tokenizer import Tokenizer
    tok = Tokenizer.from_dir(req.tok_dir)          # failures exit 1 (SYSTEM §6.5)
    printer = Printer(events, step_lines=False)
    try:
        chat_controls(tok)
    except EngineError as e:
        print(tok.report_line(), file=sys.stderr)
        print(e.report(), file=sys.stderr)
        return e.exit_code
    # Before loading the model, read one user line unless the history ends with one.
    if not history.ends_with_user:
        if _next_user_line(history, history_path) is None:
            print(tok.report_line(), file=sys.stderr)
            return EXIT_OK
    r = open_run(req, printer, tok=tok)
    chat = r.chat(history)
    gen = req.gen
    live = _interactive()
    first = True
    line = None
    code = EXIT_OK
    try:
        while True:
            if line == CONTINUE:
                code = _one_turn(r, chat, gen, printer, live, resume=True)
            else:
                try:
                    prompt = chat.render()
                except ChatError as e:
                    print(f"chat: {e}", file=sys.stderr)
                    if first:
                        return EXIT_USAGE
                    history.remove_last()
                    code = None
                else:
                    if first:
                        s = chat.sampler
                        print(f"  XTML prompt: {len(prompt)} ids, generation limit {gen}, "
                              f"{s.mode_text()}, "
                              + (f"thinking_effort={chat.opts.effort}" if chat.opts.thinking
                                 else "thinking off"))
                        if s.banner_line():
                            print(s.banner_line())
                    first = False
                    code = _one_turn(r, chat, gen, printer, live)
            if code not in (EXIT_OK, None):
                return code
            if code is not None and history_path:
                history.save(history_path)
            line = _next_user_line(history, history_path, chat if live else None)
            if line is None:
                return EXIT_OK
    finally:
        drops = r.lm.experts.drops
        r.close()
        if drops:
            print(f"chat invalid: {drops} routed expert loads failed; transcript kept",
                  file=sys.stderr)
            code = EXIT_DROP


def _next_user_line(history: History, history_path: str | None, chat=None) -> str | None:
    """Read lines until a user message is accepted (or, with `chat` in interactive mode,
    /continue for its incomplete reply); None at /exit or end of input."""
    while True:
        line = _read_line()
        if line is None or line == "/exit":
            return None
        if line == "":
            continue
        if line == CONTINUE:
            if chat is not None and chat.pending is not None:
                return line
            print("chat: there is no incomplete reply to continue", file=sys.stderr)
            continue
        if chat is not None and chat.pending is not None and history.ends_with_user:
            history.remove_last()                 # a new message replaces the unanswered one
        if line == "/help":
            for h in HELP_LINES:
                print(h)
            continue
        if line == "/reset":
            history.reset()
            if history_path:
                history.save(history_path)
            print("chat reset")
            continue
        try:
            history.add(Message("user", line))
        except ChatError as e:
            print(f"chat: {e}", file=sys.stderr)
            continue
        if history_path:
            history.save(history_path)
        return line


def _one_turn(r, chat, gen: int, printer: Printer, live: bool = False,
              resume: bool = False) -> int:
    t0 = time.monotonic()
    res = None
    n = 0
    cancel = Cancel()
    phase = None
    try:
        with _ctrl_c_stops(cancel, live):
            for ev in r.turn(chat, gen, cancel, resume=resume):
                if isinstance(ev, TokenOut):
                    if ev.id >= 0:
                        n += 1
                        if not live:
                            print(f"chat: token {n}/{gen} id {ev.id} "
                                  f"({time.monotonic() - t0:.0f} s)", file=sys.stderr, flush=True)
                    if live and ev.text and ev.phase in ("thinking", "response"):
                        if ev.phase != phase and phase == "thinking":
                            sys.stdout.write(PLAIN + "\n")
                        phase = ev.phase
                        sys.stdout.write((DIM if phase == "thinking" else "") + ev.text)
                        sys.stdout.flush()
                printer(ev)
                if isinstance(ev, TurnEnded):
                    res = ev.result
    except ChatError as e:
        print(f"chat: malformed assistant turn: {e}", file=sys.stderr)
        return EXIT_RUNTIME
    except ExpertLoadError as e:              # never show a reply computed without an expert
        print(f"chat invalid: {e}; transcript kept", file=sys.stderr)
        return EXIT_DROP
    if live:
        return _live_end(chat, res, gen, phase)
    print(f"chat: {res.reused} of {res.prompt_ids} prompt positions already cached, prefill "
          f"for {res.prompt_ids - res.reused}")
    if res.end_id is None:
        print(f"chat: assistant did not complete an official turn within --gen {gen}; "
              f"transcript is preserved", file=sys.stderr)
        return EXIT_RUNTIME
    name = chat.tok.added.get(res.end_id, str(res.end_id))
    print(f"chat: turn ended by {name} ({res.end_id})")
    if chat.opts.thinking:
        print(f"<think>{res.reasoning or ''}</think>")
    print(f"<response>{res.content}</response>")
    return EXIT_OK


def _live_end(chat, res, gen: int, phase) -> int:
    """After a streamed reply: the stats line, and what to do with an incomplete one."""
    print(PLAIN if phase == "thinking" else "")
    new = len(res.ids) - res.continued
    decode = res.seconds - res.first_token_seconds
    rate = f", {(new - 1) / decode:.2f} tokens/s" if new > 1 and decode > 0 else ""
    print(f"{DIM}[{new} tokens, first after {res.first_token_seconds:.1f} s{rate}; "
          f"{res.reused} of {res.prompt_ids} prompt positions reused]{PLAIN}")
    if res.end_id is None:
        why = "stopped" if res.interrupted else f"reached --gen {gen}"
        print(f"chat: the reply {why} before its end; {CONTINUE} goes on, a new message "
              f"replaces the question", file=sys.stderr)
    return EXIT_OK


class _ctrl_c_stops:
    """Interactive mode: Ctrl-C during a reply stops it at the next safe point (the reply
    is kept and can be continued) instead of ending the REPL."""

    def __init__(self, cancel: Cancel, live: bool):
        self.cancel, self.live, self.old = cancel, live, None

    def __enter__(self):
        if self.live:
            self.old = signal.signal(signal.SIGINT, lambda *a: self.cancel.set())
        return self

    def __exit__(self, *exc):
        if self.old is not None:
            signal.signal(signal.SIGINT, self.old)
