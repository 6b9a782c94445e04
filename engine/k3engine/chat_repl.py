"""`k3 <model> --chat`: the REPL of SYSTEM §9.4 over the run API, with the reference's
messages, history file handling and exit codes (§9.3, §9.6)."""
from __future__ import annotations

import sys
import time

from .chat import HELP_LINES, USER_PROMPT, ChatError, History, Message, apply_system
from .console import Printer
from .errors import EXIT_DROP, EXIT_OK, EXIT_RUNTIME, EXIT_USAGE, EngineError
from .events import TokenOut, TurnEnded
from .experts import ExpertLoadError
from .run import Cancel, RunRequest, chat_controls, open_run
from .telemetry import Events


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
    first = True
    code = EXIT_OK
    try:
        while True:
            try:
                prompt = chat.render()
            except ChatError as e:
                print(f"chat: {e}", file=sys.stderr)
                if first:
                    return EXIT_USAGE
                history.remove_last()
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
                code = _one_turn(r, chat, gen, printer)
                if code != EXIT_OK:
                    return code
                if history_path:
                    history.save(history_path)
            if _next_user_line(history, history_path) is None:
                return EXIT_OK
    finally:
        drops = r.lm.experts.drops
        r.close()
        if drops:
            print(f"chat invalid: {drops} routed expert loads failed; transcript kept",
                  file=sys.stderr)
            code = EXIT_DROP


def _next_user_line(history: History, history_path: str | None) -> str | None:
    """Read lines until a user message is accepted; None at /exit or end of input."""
    while True:
        line = _read_line()
        if line is None or line == "/exit":
            return None
        if line == "":
            continue
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


def _one_turn(r, chat, gen: int, printer: Printer) -> int:
    t0 = time.monotonic()
    res = None
    n = 0
    try:
        for ev in r.turn(chat, gen, Cancel()):
            if isinstance(ev, TokenOut) and ev.id >= 0:
                n += 1
                print(f"chat: token {n}/{gen} id {ev.id} ({time.monotonic() - t0:.0f} s)",
                      file=sys.stderr, flush=True)
            printer(ev)
            if isinstance(ev, TurnEnded):
                res = ev.result
    except ChatError as e:
        print(f"chat: malformed assistant turn: {e}", file=sys.stderr)
        return EXIT_RUNTIME
    except ExpertLoadError as e:              # never show a reply computed without an expert
        print(f"chat invalid: {e}; transcript kept", file=sys.stderr)
        return EXIT_DROP
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
