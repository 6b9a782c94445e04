"""`k3 <model> --chat`: the REPL of SYSTEM §9.4 on a Conversation, with the reference's
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

import json
import os
import signal
import sys
import time

from .chat import HELP_LINES, USER_PROMPT, ChatError, History, HistoryLock, apply_system
from .console import Printer
from .conversation import Conversation, ReplyDraft
from .engine import Cancel, GenSpec, LoadSpec, chat_controls, open_engine
from .errors import (EXIT_DROP, EXIT_INTERRUPTED, EXIT_OK, EXIT_RUNTIME, EXIT_USAGE,
                     EngineError)
from .events import TokenOut, TurnEnded
from .experts import ExpertLoadError
from .inputfile import InputFileError, read_regular_file
from .telemetry import Events


DIM, PLAIN = "\x1b[2m", "\x1b[0m"
CONTINUE = "/continue"
REPL_HELP = HELP_LINES[:2] + ("/continue go on with a reply that stopped before its end",) + \
    HELP_LINES[2:] + ("Ctrl-C  stop a reply (kept: /continue goes on); at the prompt, leave",)


def _interactive() -> bool:
    return sys.stdin.isatty() and sys.stdout.isatty()


def _read_line() -> str | None:
    """The next input line; None at end of input or Ctrl-C at the prompt (a clean exit:
    the history was saved when its last message was accepted).  The prompt is written
    inside the try: a Ctrl-C that lands just after it is flushed, before the read, is
    the same Ctrl-C at the prompt (test_chat_repl_tty.py, a race that showed under load)."""
    try:
        sys.stdout.write(USER_PROMPT)
        sys.stdout.flush()
        line = sys.stdin.readline()
    except KeyboardInterrupt:
        sys.stdout.write("\n")
        return None
    if not line:
        return None
    return line.rstrip("\r\n")


def chat_main(spec: LoadSpec, gen: GenSpec, history_path: str | None, system: str | None,
              events: Events, verbose: bool = False) -> int:
    try:
        # held for the whole session: a second chat on this history is refused, not raced
        lock = HistoryLock(history_path) if history_path else None
    except ChatError as e:
        print(f"chat: {e}", file=sys.stderr)
        return EXIT_USAGE
    try:
        return _chat(spec, gen, history_path, system, events, verbose)
    finally:
        if lock is not None:
            lock.release()


class _Quiet(Printer):
    """At a terminal, the engine's set-up report (plan, load, trunk) only with --verbose:
    the --events lines still go out."""

    def __call__(self, ev) -> None:
        for kind, fields in ev.json():
            self.events.emit(kind, **fields)


def _chat(spec: LoadSpec, gen: GenSpec, history_path: str | None, system: str | None,
          events: Events, verbose: bool) -> int:
    try:
        history = History.load(history_path) if history_path else History()
        if system is not None and apply_system(history, system) and history_path:
            history.save(history_path)
    except ChatError as e:
        print(f"chat: {e}", file=sys.stderr)
        return EXIT_USAGE
    from .tokenizer import Tokenizer
    tok = Tokenizer.from_dir(spec.tok_dir)          # failures exit 1 (SYSTEM §6.5)
    live = _interactive()
    printer = (Printer if verbose or not live else _Quiet)(events, step_lines=False)
    try:
        chat_controls(tok)
    except EngineError as e:
        print(tok.report_line(), file=sys.stderr)
        print(e.report(), file=sys.stderr)
        return e.exit_code
    # Before loading the model, read one user line unless the history ends with one.
    if not history.ends_with_user:
        line = _read_line()
        while line not in (None, "/exit") and not _accept(line, None, history, history_path):
            line = _read_line()
        if line is None or line == "/exit":
            print(tok.report_line(), file=sys.stderr)
            return EXIT_OK
    eng = open_engine(spec, printer, tok=tok, gen=gen.gen)
    conv = Conversation(eng, history)
    partial = PartialFile(history_path)
    first = True
    line = None
    code = EXIT_OK
    if live and history.ends_with_user and partial.restore(conv):
        print(f"chat: the reply that was being written when the last session ended is kept "
              f"({len(conv.pending.ids)} tokens); {CONTINUE} goes on, a new message replaces "
              f"the question", file=sys.stderr)
        line = _next_line(conv, history_path, live)
        if line is None:
            eng.close()
            return EXIT_OK
    try:
        while True:
            if line == CONTINUE:
                code = _one_turn(conv, gen, printer, live, resume=True, partial=partial)
            else:
                try:
                    prompt = conv.render(gen)
                except ChatError as e:
                    print(f"chat: {e}", file=sys.stderr)
                    if first:
                        return EXIT_USAGE
                    history.remove_last()
                    code = None
                else:
                    if first:
                        s = conv.sampler_for(gen.sampling)
                        print(f"  XTML prompt: {len(prompt)} ids, generation limit {gen.gen}, "
                              f"{s.mode_text()}, "
                              + (f"thinking_effort={gen.effort}" if gen.thinking
                                 else "thinking off"))
                        if s.banner_line():
                            print(s.banner_line())
                    first = False
                    code = _one_turn(conv, gen, printer, live, partial=partial)
            if code not in (EXIT_OK, None):
                return code
            if code is not None and history_path:
                history.save(history_path)
            line = _next_line(conv, history_path, live)
            if line is None:
                return EXIT_OK
    finally:
        drops = eng.lm.experts.drops
        eng.close()
        if drops:
            print(f"chat invalid: {drops} routed expert loads failed; transcript kept",
                  file=sys.stderr)
            code = EXIT_DROP


def _next_line(conv: Conversation, history_path: str | None, live: bool) -> str | None:
    """Read lines until a user message is accepted (or, in interactive mode, /continue for
    an incomplete reply); None at /exit, end of input or Ctrl-C at the prompt."""
    while True:
        line = _read_line()
        if line is None or line == "/exit":
            return None
        if line == CONTINUE and live and conv.pending is not None and conv.pending.continuable:
            return line
        if _accept(line, conv, conv.history, history_path):
            return line


def _accept(line: str, conv: Conversation | None, history: History,
            history_path: str | None) -> bool:
    """One input line: a command done here (False), or a user message added and saved
    (True; a new message replaces a question whose reply stopped before its end)."""
    if line == "":
        return False
    if line == "/help":                 # the spec's lines in a script; /continue and Ctrl-C
        for h in REPL_HELP if _interactive() else HELP_LINES:    # work at a terminal
            print(h)
        return False
    if line == "/reset":
        if conv is not None:
            conv.reset()
        else:
            history.reset()
        if history_path:
            history.save(history_path)
        print("chat reset")
        return False
    if line == CONTINUE:
        print("chat: there is no incomplete reply to continue", file=sys.stderr)
        return False
    try:
        if conv is not None:
            conv.add_user(line, answer_incomplete=False)
        else:
            from .chat import Message
            history.add(Message("user", line))
    except ChatError as e:
        print(f"chat: {e}", file=sys.stderr)
        return False
    if history_path:
        history.save(history_path)
    return True


def _one_turn(conv: Conversation, gen: GenSpec, printer: Printer, live: bool = False,
              resume: bool = False, partial: "PartialFile | None" = None) -> int:
    t0 = time.monotonic()
    res = None
    n = 0
    cancel = Cancel()
    phase = None
    draft = partial.start(conv.pending if resume else None) if partial else None
    try:
        with _ctrl_c_stops(cancel):
            for ev in (conv.continue_turn(gen, cancel) if resume else conv.turn(gen, cancel)):
                if isinstance(ev, TokenOut):
                    if draft is not None:
                        partial.stream(draft, ev)
                    if ev.id >= 0:
                        n += 1
                        if not live:
                            print(f"chat: token {n}/{gen.gen} id {ev.id} "
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
    except ExpertLoadError as e:              # never show a reply computed without an expert
        print(f"chat invalid: {e}; transcript kept", file=sys.stderr)
        return EXIT_DROP
    if partial is not None:
        partial.settle(conv.pending)
    if res.malformed is not None:
        print(f"chat: malformed assistant turn: {res.malformed}", file=sys.stderr)
        return EXIT_RUNTIME
    if live:
        return _live_end(res, gen.gen, phase)
    print(f"chat: {res.reused} of {res.prompt_positions} prompt positions already cached, "
          f"prefill for {res.prompt_positions - res.reused}")
    if res.end_id is None:
        if res.interrupted:
            print("chat: interrupted by Ctrl-C; the transcript is preserved without this "
                  "reply", file=sys.stderr)
            return EXIT_INTERRUPTED
        print(f"chat: assistant did not complete an official turn within --gen {gen.gen}; "
              f"transcript is preserved", file=sys.stderr)
        return EXIT_RUNTIME
    print(f"chat: turn ended by {res.end_name} ({res.end_id})")
    if gen.thinking:
        print(f"<think>{res.reasoning or ''}</think>")
    print(f"<response>{res.content}</response>")
    return EXIT_OK


def _live_end(res, gen: int, phase) -> int:
    """After a streamed reply: the stats line (the turn summary's figures), and what to
    do with an incomplete one."""
    print(PLAIN if phase == "thinking" else "")
    rate = res.decode_tokens_per_s
    rate = f", {rate:.2f} tokens/s" if rate > 0 else ""
    print(f"{DIM}[{res.new_ids} tokens, first after {res.first_token_seconds:.1f} s{rate}; "
          f"{res.reused} of {res.prompt_positions} prompt positions reused]{PLAIN}")
    if res.end_id is None and res.ids:
        why = "stopped" if res.interrupted else f"reached --gen {gen}"
        print(f"chat: the reply {why} before its end; {CONTINUE} goes on, a new message "
              f"replaces the question", file=sys.stderr)
    elif res.end_id is None:
        print("chat: stopped before the first token; send the message again, or another",
              file=sys.stderr)
    return EXIT_OK


class PartialFile:
    """`.NAME.partial.json` beside the --history file: the reply being written, saved as its
    first tokens come and then about once a second (0600, atomic), so a crash (kill -9)
    loses at most that much of it; the next interactive start restores it as an incomplete
    reply that /continue resumes (Conversation.continue_turn, by one pass over the
    transcript and the reply so far).  The history file itself keeps the reference's
    format: an unanswered question, as a crash always left it."""

    LIMIT = 16 << 20

    def __init__(self, history_path: str | None):
        self.path = None
        if history_path:
            d, base = os.path.split(os.path.abspath(history_path))
            self.path = os.path.join(d, f".{base}.partial.json")

    def restore(self, conv: Conversation) -> bool:
        from .conversation import PendingReply
        if self.path is None:
            return False
        try:
            raw = json.loads(read_regular_file(self.path, self.LIMIT, "partial reply"))
            ids = [int(i) for i in raw["ids"]]
            pending = PendingReply(ids, 0, 0, str(raw.get("content") or ""),
                                   raw.get("reasoning"), "stopped", continuable=bool(ids))
        except InputFileError as e:
            if not e.missing:
                print(f"chat: {self.path}: {e.problem}; ignored", file=sys.stderr)
            return False
        except (ValueError, KeyError, TypeError, RecursionError):
            print(f"chat: {self.path}: not a saved reply; ignored", file=sys.stderr)
            return False
        conv.pending = pending
        return bool(ids)

    def start(self, prior) -> ReplyDraft | None:
        if self.path is None:
            return None
        return ReplyDraft(prior.ids, prior.content, prior.reasoning or "") if prior \
            else ReplyDraft()

    def stream(self, d: ReplyDraft, ev) -> None:
        d.push(ev.id, ev.phase, ev.text)
        if d.due():
            self._write(d.as_dict())

    def settle(self, pending) -> None:
        """After the turn: the incomplete reply kept (or the file gone: the reply closed,
        or nothing to keep)."""
        if self.path is None:
            return
        if pending is not None and pending.ids:
            self._write(dict(ids=list(pending.ids), content=pending.content,
                             reasoning=pending.reasoning))
        else:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def _write(self, d: dict) -> None:
        from .atomic import write_atomic
        try:
            write_atomic(self.path, json.dumps(d).encode(),
                         inside=os.path.dirname(self.path))
        except OSError as e:                   # a full disk costs the crash copy, not the chat
            print(f"chat: cannot save {self.path}: {e.strerror or e}", file=sys.stderr)


class _ctrl_c_stops:
    """Ctrl-C during a reply stops it at the next safe point (between the prompt pass's
    layers or between tokens) instead of raising into the engine: at a terminal the reply
    is kept (/continue goes on); in a script the REPL then exits 5 with the transcript
    as it was."""

    def __init__(self, cancel: Cancel):
        self.cancel, self.old = cancel, None

    def __enter__(self):
        self.old = signal.signal(signal.SIGINT, lambda *a: self.cancel.set())
        return self

    def __exit__(self, *exc):
        if self.old is not None:
            signal.signal(signal.SIGINT, self.old)
