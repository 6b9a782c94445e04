"""`k3 <model> --chat`: the REPL of SYSTEM §9.4 over the engine's ChatSession, with the
reference's messages, history file handling and exit codes (§9.3, §9.6)."""
from __future__ import annotations

import sys
import time

from .chat import (HELP_LINES, USER_PROMPT, ChatError, ChatOptions, History, Message,
                   apply_system)
from .experts import ExpertLoadError
from .telemetry import Events

EXIT_OK, EXIT_RUNTIME, EXIT_USAGE, EXIT_DROP = 0, 1, 2, 4


def _read_line() -> str | None:
    sys.stdout.write(USER_PROMPT)
    sys.stdout.flush()
    line = sys.stdin.readline()
    if not line:
        return None
    return line.rstrip("\r\n")


def chat_main(o, events: Events) -> int:
    from .cli import UsageError, load_tokenizer, make_sampler, prepare
    from .tokenizer import TokenizerError, control_ids
    opts = ChatOptions(thinking=not o.no_think, effort=o.effort or "max")
    try:
        history = History.load(o.history) if o.history else History()
        if o.system is not None and apply_system(history, o.system) and o.history:
            history.save(o.history)
    except ChatError as e:
        print(f"chat: {e}", file=sys.stderr)
        return EXIT_USAGE
    tok = load_tokenizer(o.tok)
    try:
        ctl = control_ids(tok, None)
    except TokenizerError as e:
        print(f"chat: {e}", file=sys.stderr)
        return EXIT_USAGE
    # Before loading the model, read one user line unless the history ends with one.
    if not history.ends_with_user:
        line = _next_user_line(history, o)
        if line is None:
            return EXIT_OK
    sampler = make_sampler(o)
    p = prepare(o, events)
    from .session import Cancel, ChatSession
    chat = ChatSession(p.lm, tok, ctl, history, opts, sampler, incremental=True)
    gen = o.gen_n
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
                    print(f"  XTML prompt: {len(prompt)} ids, generation limit {gen}, "
                          f"{sampler.mode_text()}, "
                          + (f"thinking_effort={opts.effort}" if opts.thinking else "thinking off"))
                    if sampler.banner_line():
                        print(sampler.banner_line())
                first = False
                code = _one_turn(chat, gen, events, Cancel())
                if code != EXIT_OK:
                    return code
                if o.history:
                    history.save(o.history)
            if _next_user_line(history, o) is None:
                return EXIT_OK
    finally:
        drops = p.lm.experts.drops
        p.lm.close()
        if drops:
            print(f"chat invalid: {drops} routed expert loads failed; transcript kept",
                  file=sys.stderr)
            code = EXIT_DROP
        del UsageError


def _next_user_line(history: History, o) -> str | None:
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
            if o.history:
                history.save(o.history)
            print("chat reset")
            continue
        try:
            history.add(Message("user", line))
        except ChatError as e:
            print(f"chat: {e}", file=sys.stderr)
            continue
        if o.history:
            history.save(o.history)
        return line


def _one_turn(chat, gen: int, events: Events, cancel) -> int:
    t0 = time.monotonic()

    def on_token(i: int, tok_id: int) -> None:
        print(f"chat: token {i}/{gen} id {tok_id} ({time.monotonic() - t0:.0f} s)",
              file=sys.stderr, flush=True)
        events.emit("token", id=tok_id, text_delta="")
    try:
        r = chat.turn(gen, on_token, cancel)
    except ChatError as e:
        print(f"chat: malformed assistant turn: {e}", file=sys.stderr)
        return EXIT_RUNTIME
    except ExpertLoadError as e:              # never show a reply computed without an expert
        print(f"chat invalid: {e}; transcript kept", file=sys.stderr)
        return EXIT_DROP
    events.emit("chat", phase="turn_end", reused_positions=r.reused, end_id=r.end_id)
    print(f"chat: {r.reused} of {r.prompt_ids} prompt positions already cached, prefill for "
          f"{r.prompt_ids - r.reused}")
    if r.end_id is None:
        print(f"chat: assistant did not complete an official turn within --gen {gen}; "
              f"transcript is preserved", file=sys.stderr)
        return EXIT_RUNTIME
    name = chat.tok.added.get(r.end_id, str(r.end_id))
    print(f"chat: turn ended by {name} ({r.end_id})")
    if chat.opts.thinking:
        print(f"<think>{r.reasoning or ''}</think>")
    print(f"<response>{r.content}</response>")
    return EXIT_OK
