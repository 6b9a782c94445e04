"""Chat (SYSTEM §9): XTML bytes and ids, effort validation, control-text injection, the strict
reply parser, the JSONL history (reader, writer, atomic save), prefix reuse, REPL helpers.

Three tokenizers are used:
* `ByteTok`: a fake whose ordinary text is one id per UTF-8 byte and whose added tokens are
  the six K3 control names at the K3 ids (plus reserved ones), for structure and parsing;
* `VectorTok`: a fake that knows exactly the text pieces of the §9.7 vectors with their
  official ids, so the official vectors are reproduced from our segments;
* the real `k3engine.tokenizer` on our shipped vocabulary when it is present, and on the
  released Kimi files when `K3_TOK_FILES` names them (NOT RUN otherwise).
"""
from __future__ import annotations

import os
import pathlib
import stat
from types import SimpleNamespace

import pytest

from k3engine import chat
from k3engine.chat import (ChatError, ChatOptions, History, Message, apply_system,
                           classify_line, effort_text, encode_prompt, parse_reply,
                           render_segments, render_text, reuse_positions)

from conftest import shared_dir

BOS, EOS, EOM, OPEN, CLOSE, SEP = 163584, 163585, 163586, 163587, 163588, 163589
CTL = SimpleNamespace(bos=BOS, eos=EOS, end_of_msg=EOM, open=OPEN, close=CLOSE, sep=SEP,
                      end_ids=(EOM, EOS))
NAMES = {"[BOS]": BOS, "[EOS]": EOS, "<|end_of_msg|>": EOM, "<|open|>": OPEN,
         "<|close|>": CLOSE, "<|sep|>": SEP}


class ByteTok:
    """Ordinary text -> one id per UTF-8 byte (0..255); added tokens at the K3 ids."""

    def __init__(self, names: dict[str, int] = NAMES, reserved: int = 4):
        self.added = {i: c for c, i in names.items()}
        for k in range(reserved):
            self.added[163590 + k] = f"<|reserved_token_{k}|>"
        self._id = {c: i for i, c in self.added.items()}

    def encode(self, text: str, allow_special: bool) -> list[int]:
        out, i = [], 0
        while i < len(text):
            hit = None
            if allow_special:
                for j in range(i, len(text)):
                    cands = [c for c in self._id if text.startswith(c, j)]
                    if cands:
                        hit = (j, max(cands, key=len))
                        break
            end = hit[0] if hit else len(text)
            out += list(text[i:end].encode("utf-8"))
            if not hit:
                break
            out.append(self._id[hit[1]])
            i = hit[0] + len(hit[1])
        return out

    def decode(self, ids) -> bytes:
        return b"".join(bytes([i]) if i < 256 else self.added[i].encode() for i in ids
                        if i < 256 or i in self.added)

    def id_of(self, content: str):
        return self._id.get(content)


# --------------------------------------------------------------------------- §9.2 / §9.7 data

EFFORT_MAX = ("`thinking_effort` guides on how much to think in your thinking channel (not "
              "including the response channel), supported values include `low`, `medium`, "
              "`high`, and `max`.\nNow the system is invoked with `thinking_effort=max`.")

# §9.2's rendered bytes for [system "You are helpful.", user "Hello"], defaults (verbatim).
SPEC_DEFAULT_BYTES = (
    '<|open|>message role="system" type="thinking-effort"<|sep|>`thinking_effort` guides on '
    'how much to think in your thinking channel (not including the response channel), '
    'supported values include `low`, `medium`, `high`, and `max`.\n'
    'Now the system is invoked with `thinking_effort=max`.<|close|>message<|sep|>'
    '<|end_of_msg|><|open|>message role="system"<|sep|>You are helpful.<|close|>message<|sep|>'
    '<|end_of_msg|><|open|>message role="user"<|sep|>Hello<|close|>message<|sep|>'
    '<|end_of_msg|><|open|>message role="assistant"<|sep|><|open|>think<|sep|>')
SPEC_PRIOR_ASSISTANT = (
    '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>REASONING<|close|>think<|sep|>'
    '<|open|>response<|sep|>CONTENT<|close|>response<|sep|><|close|>message<|sep|>'
    '<|end_of_msg|>')

# §9.7 official ids.
V_DEFAULT = [
    163587, 2778, 6244, 878, 14062, 1, 1798, 878, 130400, 59991, 470, 1, 163589, 63, 130400,
    123074, 470, 63, 28560, 418, 1632, 2455, 308, 2704, 306, 651, 9545, 8491, 347, 2976, 3411,
    276, 4503, 8491, 904, 9141, 4661, 3867, 1268, 1332, 5713, 1268, 50004, 5713, 1268, 19421,
    5713, 316, 1268, 5354, 16518, 10048, 276, 2403, 387, 42070, 472, 1268, 130400, 123074, 470,
    105281, 11369, 163588, 2778, 163589, 163586, 163587, 2778, 6244, 878, 14062, 1, 163589,
    3900, 554, 13205, 13, 163588, 2778, 163589, 163586, 163587, 2778, 6244, 878, 2482, 1,
    163589, 19180, 163588, 2778, 163589, 163586, 163587, 2778, 6244, 878, 69702, 1, 163589,
    163587, 39964, 163589]
V_LOW = V_DEFAULT[:61] + [28, 1332] + V_DEFAULT[62:]  # `=max` (one id) -> `=low` (two ids)
V_NOTHINK = [
    163587, 2778, 6244, 878, 14062, 1, 163589, 3900, 554, 13205, 13, 163588, 2778, 163589, 163586,
    163587, 2778, 6244, 878, 2482, 1, 163589, 19180, 163588, 2778, 163589, 163586, 163587, 2778,
    6244, 878, 69702, 1, 163589, 163587, 12092, 163589]
V_NOTHINK_TURNS = [
    163587, 2778, 6244, 878, 2482, 1, 163589, 38587, 30, 163588, 2778, 163589, 163586, 163587,
    2778, 6244, 878, 69702, 1, 163589, 163587, 12092, 163589, 42780, 11, 220, 49114, 11, 220,
    23782, 163588, 12092, 163589, 163588, 2778, 163589, 163586, 163587, 2778, 6244, 878, 2482, 1,
    163589, 5376, 1646, 276, 1356, 2069, 30, 163588, 2778, 163589, 163586, 163587, 2778, 6244,
    878, 69702, 1, 163589, 163587, 12092, 163589]

H_HELLO = [Message("system", "You are helpful."), Message("user", "Hello")]
H_NUMBERS = [Message("user", "Numbers?"),
             Message("assistant", "473, 921, 235", "I'll remember 215 and 222."),
             Message("user", "What were the other two?")]


class VectorTok:
    """Knows only the text pieces of the §9.7 vectors, with their official ids (read off the
    vectors; §9.7 names message/think/response). Unknown text is an error, so a segment that
    differs from the official layout by one character fails loudly."""

    def __init__(self):
        effort_ids = V_DEFAULT[13:V_DEFAULT.index(CLOSE)]
        self.table = {
            "message": [2778], "think": [39964], "response": [12092],
            ' role="system" type="thinking-effort"': [6244, 878, 14062, 1, 1798, 878, 130400,
                                                      59991, 470, 1],
            ' role="system"': [6244, 878, 14062, 1], ' role="user"': [6244, 878, 2482, 1],
            ' role="assistant"': [6244, 878, 69702, 1],
            "You are helpful.": [3900, 554, 13205, 13], "Hello": [19180],
            "Numbers?": [38587, 30], "473, 921, 235": [42780, 11, 220, 49114, 11, 220, 23782],
            "What were the other two?": [5376, 1646, 276, 1356, 2069, 30],
            EFFORT_MAX: effort_ids,
            EFFORT_MAX.replace("=max`", "=low`"): [28 if i == 105281 else i for i in effort_ids]
            [:effort_ids.index(105281) + 1] + [1332] + effort_ids[effort_ids.index(105281) + 1:],
        }
        self.added = {i: c for c, i in NAMES.items()}
        self._runs = {tuple(v): k for k, v in self.table.items()}

    def encode(self, text: str, allow_special: bool) -> list[int]:
        if allow_special and text in NAMES:
            return [NAMES[text]]
        return list(self.table[text])

    def decode(self, ids) -> bytes:
        ids, out, i = list(ids), [], 0
        while i < len(ids):
            if ids[i] in self.added:
                out.append(self.added[ids[i]])
                i += 1
                continue
            for j in range(len(ids), i, -1):  # longest known run
                if tuple(ids[i:j]) in self._runs:
                    out.append(self._runs[tuple(ids[i:j])])
                    i = j
                    break
            else:
                raise KeyError(ids[i:])
        return "".join(out).encode()

    def id_of(self, content: str):
        return NAMES.get(content)


# --------------------------------------------------------------------------- rendering (§9.2)


def test_spec_literals_transcribed_faithfully():
    spec = shared_dir() / "spec" / "SYSTEM.md"
    if not spec.is_file():
        pytest.skip(f"{spec} not found: transcription check not run")
    text = spec.read_text()
    assert SPEC_DEFAULT_BYTES in text and SPEC_PRIOR_ASSISTANT in text and EFFORT_MAX in text


def test_default_render_bytes_exact():
    assert render_text(H_HELLO) == SPEC_DEFAULT_BYTES
    assert render_text(H_HELLO, ChatOptions(thinking=True, effort="max")) == SPEC_DEFAULT_BYTES
    assert effort_text("max") == EFFORT_MAX


@pytest.mark.parametrize("effort", ["low", "high", "max"])
def test_effort_changes_only_the_effort_word(effort):
    got = render_text(H_HELLO, ChatOptions(effort=effort))
    assert got == SPEC_DEFAULT_BYTES.replace("`thinking_effort=max`", f"`thinking_effort={effort}`")


@pytest.mark.parametrize("effort", ["medium", "MAX", "", "none", None])
def test_invalid_effort_refused(effort):
    with pytest.raises(ChatError, match="thinking_effort must be low, high or max"):
        ChatOptions(effort=effort)
    with pytest.raises(ChatError):
        effort_text(effort)


def test_no_think_render_bytes():
    assert render_text(H_HELLO, ChatOptions(thinking=False)) == (
        '<|open|>message role="system"<|sep|>You are helpful.<|close|>message<|sep|>'
        '<|end_of_msg|><|open|>message role="user"<|sep|>Hello<|close|>message<|sep|>'
        '<|end_of_msg|><|open|>message role="assistant"<|sep|><|open|>response<|sep|>')


def test_prior_assistant_turn_with_reasoning():
    h = [Message("user", "Q"), Message("assistant", "CONTENT", "REASONING"), Message("user", "R")]
    on = render_text(h)
    assert SPEC_PRIOR_ASSISTANT in on
    assert on.endswith('<|open|>message role="user"<|sep|>R<|close|>message<|sep|><|end_of_msg|>'
                       '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>')
    # --no-think: no think channel although reasoning is stored; it stays in the history.
    off = render_text(h, ChatOptions(thinking=False))
    assert "REASONING" not in off and "think" not in off
    assert ('<|open|>message role="assistant"<|sep|><|open|>response<|sep|>CONTENT<|close|>'
            'response<|sep|><|close|>message<|sep|><|end_of_msg|>') in off
    assert off.endswith("<|open|>response<|sep|>")
    assert History(h)[1].reasoning_content == "REASONING"


def test_prior_assistant_turn_without_reasoning_has_empty_think_channel():
    h = [Message("user", "Q"), Message("assistant", "A"), Message("user", "R")]
    assert ('<|open|>message role="assistant"<|sep|><|open|>think<|sep|><|close|>think<|sep|>'
            '<|open|>response<|sep|>A<|close|>response<|sep|><|close|>message<|sep|>'
            '<|end_of_msg|>') in render_text(h)


def test_without_generation_prompt_and_empty_history():
    assert render_text(H_HELLO, generation_prompt=False) == SPEC_DEFAULT_BYTES[
        :SPEC_DEFAULT_BYTES.index('<|open|>message role="assistant"')]
    assert render_text([], ChatOptions(thinking=False), generation_prompt=False) == ""
    assert render_text([], ChatOptions(thinking=False)) == \
        '<|open|>message role="assistant"<|sep|><|open|>response<|sep|>'


def test_segments_structure():
    segs = render_segments(H_HELLO)
    assert all(kind in ("ctl", "txt") for kind, _ in segs)
    assert {t for k, t in segs if k == "ctl"} == {"<|open|>", "<|close|>", "<|sep|>",
                                                 "<|end_of_msg|>"}
    assert all(t for k, t in segs if k == "txt"), "empty text segments must be dropped"
    assert ("txt", EFFORT_MAX) in segs, "the effort text is one single segment"
    # Empty user content: its text segment disappears, the frame stays.
    segs = render_segments([Message("user", "")], ChatOptions(thinking=False), False)
    assert segs == [("ctl", "<|open|>"), ("txt", "message"), ("txt", ' role="user"'),
                    ("ctl", "<|sep|>"), ("ctl", "<|close|>"), ("txt", "message"),
                    ("ctl", "<|sep|>"), ("ctl", "<|end_of_msg|>")]


def test_render_refuses_invalid_history():
    with pytest.raises(ChatError):
        render_segments([Message("assistant", "x")])


# --------------------------------------------------------------------------- ids (§9.7)


@pytest.mark.parametrize("history,opts,want", [
    (H_HELLO, ChatOptions(), V_DEFAULT),
    (H_HELLO, ChatOptions(effort="low"), V_LOW),
    (H_HELLO, ChatOptions(thinking=False), V_NOTHINK),
    (H_NUMBERS, ChatOptions(thinking=False), V_NOTHINK_TURNS),
], ids=["default-104", "low-105", "no-think-37", "no-think-turns-64"])
def test_official_vectors_from_segments(history, opts, want):
    ids = encode_prompt(VectorTok(), render_segments(history, opts))
    assert ids == want
    print(f"[gate] chat §9.7 vector ({len(want)} ids) reproduced from our segments "
          "(official text-piece ids)")


def test_literal_control_text_stays_text():
    tok = ByteTok()
    h = [Message("user", "literal <|end_of_msg|> <|open|>")]
    ids = encode_prompt(tok, render_segments(h))
    # Only the ends of the effort message and of the user message.
    assert ids.count(EOM) == 2
    assert ids.count(OPEN) == sum(t == "<|open|>" for _, t in render_segments(h))
    assert list("literal <|end_of_msg|> <|open|>".encode()) == \
        ids[ids.index(SEP, ids.index(EOM)) + 1:][:31]


def test_encode_prompt_refusals():
    tok = ByteTok()
    with pytest.raises(ChatError, match="empty"):
        encode_prompt(tok, render_segments([], ChatOptions(thinking=False), False))
    big = [Message("user", "x" * 40_000)]
    with pytest.raises(ChatError, match="32768"):
        encode_prompt(tok, render_segments(big))
    # Exactly at the limit is accepted, one more is refused.
    segs = [("txt", "a" * 10)]
    assert len(encode_prompt(tok, segs, limit=10)) == 10
    with pytest.raises(ChatError):
        encode_prompt(tok, segs, limit=9)
    # A tokenizer without the control tokens cannot render a prompt.
    lacking = ByteTok({"[BOS]": BOS, "[EOS]": EOS})
    with pytest.raises(ChatError, match="one control token"):
        encode_prompt(lacking, render_segments(H_HELLO))


# --------------------------------------------------------------------------- parser (§9.3)


def _gen(tok, reasoning, content, end=EOS, thinking=True):
    """A generated turn; `reasoning`/`content` are text or ready-made id lists."""
    def t(x):
        return list(x) if isinstance(x, list) else tok.encode(x, False)
    ids = []
    if thinking:
        ids += t(reasoning) + [CLOSE] + t("think") + [SEP, OPEN] + t("response") + [SEP]
    ids += t(content) + [CLOSE] + t("response") + [SEP, CLOSE] + t("message") + [SEP]
    return ids + ([end] if end is not None else [])


@pytest.mark.parametrize("end", [EOS, EOM])
def test_parser_accepts_both_end_ids(end):
    tok = ByteTok()
    assert parse_reply(tok, CTL, _gen(tok, "hmm, think", "Paris.", end), True) == \
        ("hmm, think", "Paris.")
    assert parse_reply(tok, CTL, _gen(tok, "", "Paris.", end, thinking=False), False) == \
        (None, "Paris.")


def test_parser_empty_reasoning_and_content():
    tok = ByteTok()
    assert parse_reply(tok, CTL, _gen(tok, "", ""), True) == ("", "")


def test_parser_on_official_ids():
    tok = VectorTok()
    ids = _gen(tok, "", "473, 921, 235", EOM, thinking=False)
    assert ids[:-1] == V_NOTHINK_TURNS[23:36]
    assert parse_reply(tok, CTL, ids, False) == (None, "473, 921, 235")


def test_parser_keeps_text_that_looks_like_markup():
    tok = ByteTok()
    text = "literally <|close|>response<|sep|> and </think>"
    assert parse_reply(tok, CTL, _gen(tok, text, text), True) == (text, text)


@pytest.mark.parametrize("case,match", [
    ("missing_end", "missing end id"),
    ("double_end", "2 ids after the closure"),
    ("trailing_text", "ids after the closure"),
    ("not_an_end_id", "not an end id"),
    ("bos_as_end", "not an end id"),
    ("no_boundary", "boundary"),
    ("no_closure", "closure"),
    ("ctl_in_reasoning", "unexpected control token 163589 in the reasoning"),
    ("reserved_in_content", "unexpected control token 163591 in the response"),
    ("end_in_content", "unexpected control token 163586 in the response"),
    ("ctl_before_boundary", "unexpected control token 163587 in the reasoning"),
    ("empty", "no ids"),
    ("think_ids_with_thinking_off", "unexpected control token"),
])
def test_parser_rejects(case, match):
    tok = ByteTok()
    good = _gen(tok, "r", "c")
    ids = {
        "missing_end": good[:-1],
        "double_end": good + [EOM],
        "trailing_text": good[:-1] + [ord("x"), EOS],
        "not_an_end_id": good[:-1] + [ord("x")],
        "bos_as_end": good[:-1] + [BOS],
        "no_boundary": _gen(tok, "", "c", thinking=False),
        "no_closure": good[:-3] + [EOS],
        "ctl_in_reasoning": _gen(tok, [ord("r"), SEP], "c"),
        "reserved_in_content": _gen(tok, "r", [ord("c"), 163591]),
        "end_in_content": _gen(tok, "", [EOM, ord("c")], thinking=False),
        "ctl_before_boundary": _gen(tok, [OPEN] + tok.encode("think", False) + [SEP], "c"),
        "empty": [],
        "think_ids_with_thinking_off": good,
    }[case]
    thinking = case not in ("think_ids_with_thinking_off", "end_in_content")
    with pytest.raises(ChatError, match=match):
        parse_reply(tok, CTL, ids, thinking)


# --------------------------------------------------------------------------- history rules


def test_history_rules_refuse_and_do_not_add():
    h = History()
    with pytest.raises(ChatError):
        h.add(Message("assistant", "a"))  # must start with user (or system)
    h.add(Message("system", "s"))
    for bad in (Message("system", "s2"), Message("assistant", "a")):
        with pytest.raises(ChatError):
            h.add(bad)
    assert len(h) == 1
    h.add(Message("user", "u"))
    with pytest.raises(ChatError, match="expected 'assistant'"):
        h.add(Message("user", "u2"))
    h.add(Message("assistant", "a", "r"))
    assert len(h) == 3 and h.assistant_count() == 1 and not h.ends_with_user
    h.add(Message("user", "u3"))
    assert h.ends_with_user
    assert h.remove_last() == Message("user", "u3")


@pytest.mark.parametrize("kwargs", [
    dict(role="user", content="x", reasoning_content="r"),
    dict(role="system", content="x", reasoning_content=""),
    dict(role="tool", content="x"),
    dict(role="user", content=5),
    dict(role="user", content="a\x00b"),
    dict(role="user", content="\ud800"),
    dict(role="assistant", content="x", reasoning_content=3),
])
def test_invalid_messages_refused(kwargs):
    with pytest.raises(ChatError):
        Message(**kwargs)


def test_reset_keeps_system_message(tmp_path):
    h = History([Message("system", "S"), Message("user", "u"), Message("assistant", "a")])
    h.reset()
    assert h.messages == (Message("system", "S"),)
    h.add(Message("user", "again"))  # still a valid place to continue
    p = tmp_path / "h.jsonl"
    h.reset()
    h.save(p)
    assert p.read_bytes() == b'{"role":"system","content":"S"}\n'
    h2 = History([Message("user", "u")])
    h2.reset()
    assert len(h2) == 0


def test_apply_system():
    h = History()
    assert apply_system(h, "Be brief.") is True and h.system == Message("system", "Be brief.")
    assert apply_system(h, "Be brief.") is False
    with pytest.raises(ChatError, match="differs"):
        apply_system(h, "Be long.")
    with pytest.raises(ChatError, match="does not start with a system"):
        apply_system(History([Message("user", "u")]), "Be brief.")


# --------------------------------------------------------------------------- JSONL (§9.1)

NASTY = 'quote " backslash \\ nl \n cr \r tab \t ctl \x01\x1f del \x7f é 漢 😀 \u2028 </x>'


def test_writer_bytes_exact(tmp_path):
    h = History([Message("system", "S"), Message("user", NASTY),
                 Message("assistant", "A", "R\n"), Message("user", "u"), Message("assistant", "B")])
    p = tmp_path / "h.jsonl"
    h.save(p)
    assert p.read_bytes() == (
        b'{"role":"system","content":"S"}\n'
        b'{"role":"user","content":"quote \\" backslash \\\\ nl \\n cr \\r tab \\t ctl '
        b'\\u0001\\u001f del \x7f \xc3\xa9 \xe6\xbc\xa2 \xf0\x9f\x98\x80 \xe2\x80\xa8 </x>"}\n'
        b'{"role":"assistant","content":"A","reasoning_content":"R\\n"}\n'
        b'{"role":"user","content":"u"}\n'
        b'{"role":"assistant","content":"B"}\n')
    assert History.load(p) == h
    assert stat.S_IMODE(p.stat().st_mode) == 0o600


def test_round_trip_every_code_point_class(tmp_path):
    text = "".join(chr(c) for c in range(1, 0x800)) + "\U0010FFFF\uFFFD"
    h = History([Message("user", text), Message("assistant", text, text)])
    p = tmp_path / "h.jsonl"
    h.save(p)
    assert History.load(p) == h


def test_reader_accepts_json_spellings(tmp_path):
    p = tmp_path / "h.jsonl"
    p.write_bytes(b' { "content" : "a\\/\\b\\f\\u00e9\\ud83d\\ude00" ,\t"role":"user" } \r\n'
                  b'{"role":"assistant","content":"x","reasoning_content":""}')  # no final \n
    h = History.load(p)
    assert h.messages == (Message("user", "a/\b\f\u00e9\U0001F600"),
                          Message("assistant", "x", ""))


def test_missing_file_is_empty_history(tmp_path):
    assert len(History.load(tmp_path / "nope.jsonl")) == 0
    (tmp_path / "empty.jsonl").write_bytes(b"")
    assert len(History.load(tmp_path / "empty.jsonl")) == 0


GOOD = b'{"role":"user","content":"hi"}'


@pytest.mark.parametrize("second_line,why", [
    (b"", "is blank"),
    (b'{"role":"assistant","content":"a","mood":"x"}', "unknown key 'mood'"),
    (b'{"role":"assistant","content":"a","content":"b"}', "duplicate key 'content'"),
    (b'{"role":"assistant","rol\\u0065":"assistant","content":"a"}', "duplicate key 'role'"),
    (b'{"role":"assistant","content":5}', "not a string"),
    (b'{"role":"assistant","content":null}', "not a string"),
    (b'{"role":"assistant","content":["a"]}', "not a string"),
    (b'{"role":"assistant","content":"a"} x', "trailing data"),
    (b'{"role":"assistant","content":"a"}{}', "trailing data"),
    (b'{"role":"assistant","content":"a\tb"}', "control byte 0x09"),
    (b'{"role":"assistant","content":"a\x01b"}', "control byte 0x01"),
    (b'{"role":"assistant","content":"\\ud800"}', "unpaired high surrogate"),
    (b'{"role":"assistant","content":"\\ud800\\u0041"}', "unpaired high surrogate"),
    (b'{"role":"assistant","content":"\\udc00"}', "unpaired low surrogate"),
    (b'{"role":"assistant","content":"\\u0000"}', "u0000"),
    (b'{"role":"assistant","content":"\\u12"}', "bad \\\\u escape"),
    (b'{"role":"assistant","content":"\\x"}', "unknown escape"),
    (b'{"role":"assistant","content":"abc', "unterminated"),
    (b'{"role":"assistant","content":"a"', "expected ',' or '}'"),
    (b'["role","assistant"]', "not a JSON object"),
    (b' ', "not a JSON object"),
    (b'{"role":"assistant","content":"\xff"}', "invalid UTF-8"),
    (b'{"role":"assistant"}', "needs both role and content"),
    (b'{"role":"robot","content":"a"}', "unknown role"),
    (b'{"role":"user","content":"a","reasoning_content":"r"}', "only allowed on assistant"),
    (b'{"role":"user","content":"a"}', "expected 'assistant'"),   # validation, by line
    (b'{"role":"system","content":"a"}', "system message may only come first"),
])
def test_malformed_line_refused_with_path_and_line(tmp_path, second_line, why):
    p = tmp_path / "h.jsonl"
    p.write_bytes(GOOD + b"\n" + second_line + b"\n" + GOOD + b"\n")
    with pytest.raises(ChatError) as e:
        History.load(p)
    msg = str(e.value)
    assert msg.startswith(f"{p}:2"), msg
    assert why.replace("\\\\", "\\") in msg, msg


def test_line_length_limit(tmp_path):
    p = tmp_path / "h.jsonl"
    frame = len(b'{"role":"user","content":""}')
    content = b"x" * (chat.MAX_LINE_BYTES - frame)
    p.write_bytes(b'{"role":"user","content":"' + content + b'"}\n')
    assert len(History.load(p)[0].content) == len(content)  # exactly 16 MiB: accepted
    p.write_bytes(GOOD + b"\n" + b'{"role":"assistant","content":"' + content + b'x"}\n')
    with pytest.raises(ChatError, match=f"^{p}:2 exceeds 16 MiB"):
        History.load(p)


# --------------------------------------------------------------------------- atomic save


def _files(d: pathlib.Path) -> list[str]:
    return sorted(x.name for x in d.iterdir())


def test_save_replaces_atomically_and_leaves_no_temp(tmp_path):
    p = tmp_path / "h.jsonl"
    History([Message("user", "one")]).save(p)
    ino = p.stat().st_ino
    History([Message("user", "two")]).save(p)
    assert p.read_bytes() == b'{"role":"user","content":"two"}\n'
    assert p.stat().st_ino != ino  # a new file renamed over the old one
    assert _files(tmp_path) == ["h.jsonl"]


def test_failed_rename_leaves_old_file_byte_identical(tmp_path, monkeypatch):
    p = tmp_path / "h.jsonl"
    History([Message("system", "S"), Message("user", "old")]).save(p)
    before = p.read_bytes()

    def boom(src, dst, **dir_fds):       # write_atomic renames under a directory descriptor
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(chat.os, "replace", boom)
    with pytest.raises(ChatError, match=f"^{p}: cannot save history"):
        History([Message("user", "new")]).save(p)
    assert p.read_bytes() == before
    assert _files(tmp_path) == ["h.jsonl"]


def test_failed_fsync_leaves_old_file_and_no_temp(tmp_path, monkeypatch):
    p = tmp_path / "h.jsonl"
    History([Message("user", "old")]).save(p)
    before = p.read_bytes()

    def boom(fd):
        raise OSError(5, "Input/output error")
    monkeypatch.setattr(chat.os, "fsync", boom)
    with pytest.raises(ChatError, match="Input/output error"):
        History([Message("user", "new")]).save(p)
    assert p.read_bytes() == before
    assert _files(tmp_path) == ["h.jsonl"]


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0,
                    reason="root ignores directory permissions")
def test_read_only_directory_leaves_old_file_byte_identical(tmp_path):
    d = tmp_path / "ro"
    d.mkdir()
    p = d / "h.jsonl"
    History([Message("user", "old")]).save(p)
    before = p.read_bytes()
    d.chmod(0o500)
    try:
        with pytest.raises(ChatError, match="cannot save history"):
            History([Message("user", "new")]).save(p)
    finally:
        d.chmod(0o700)
    assert p.read_bytes() == before
    assert _files(d) == ["h.jsonl"]


def test_failed_temp_creation_leaves_old_file_byte_identical(tmp_path, monkeypatch):
    # The read-only-directory case for a process that directory permissions do not stop.
    p = tmp_path / "h.jsonl"
    History([Message("user", "old")]).save(p)
    before = p.read_bytes()

    def boom(*args, **kwargs):
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(chat.os, "open", boom)            # the temp file's creation
    with pytest.raises(ChatError, match="Permission denied"):
        History([Message("user", "new")]).save(p)
    assert p.read_bytes() == before
    assert _files(tmp_path) == ["h.jsonl"]


def test_unreadable_history_is_an_error_not_empty(tmp_path):
    with pytest.raises(ChatError, match="cannot read history"):
        History.load(tmp_path)  # a directory


# --------------------------------------------------------------------------- prefix reuse


@pytest.mark.parametrize("record,prompt,kw,want", [
    ([1, 2, 3], [1, 2, 3, 4, 5], {}, 3),                     # full match, prompt longer
    ([1, 2, 3], [1, 2, 3], {}, 0),                           # equal length: no rewind
    ([1, 2, 3, 4], [1, 2, 3], {}, 0),                        # prompt shorter
    ([1, 2, 9], [1, 2, 3, 4], {}, 0),                        # partial match reuses nothing
    ([], [1, 2], {}, 0),                                     # nothing cached
    ([1, 2], [1, 2, 3], dict(tainted=True), 0),              # failed forward
    ([1, 2], [1, 2, 3], dict(cached=1), 0),                  # record and cache disagree
    ([1, 2], [1, 2, 3], dict(cached=2), 2),
])
def test_reuse_positions(record, prompt, kw, want):
    assert reuse_positions(record, prompt, **kw) == want


def test_reuse_across_a_turn_with_our_renderer():
    """The record after a thinking turn (prompt + generated ids, end id not fed) is a strict
    prefix of the next turn's prompt whichever end id the model used."""
    tok = ByteTok()
    h = History([Message("user", "Q1")])
    prompt = encode_prompt(tok, render_segments(h))
    gen = _gen(tok, "why", "because", EOS)
    record = prompt + gen[:-1]
    h.add(Message("assistant", *reversed(parse_reply(tok, CTL, gen, True))))
    h.add(Message("user", "Q2"))
    nxt = encode_prompt(tok, render_segments(h))
    assert reuse_positions(record, nxt) == len(record)
    assert chat.reuse_line(len(record), len(nxt)) == \
        f"chat: {len(record)} of {len(nxt)} prompt positions already cached, " \
        f"prefill for {len(nxt) - len(record)}"


# --------------------------------------------------------------------------- REPL and lines


@pytest.mark.parametrize("line,want", [
    ("/exit\n", ("exit", "/exit")), ("/help\r\n", ("help", "/help")),
    ("/reset", ("reset", "/reset")),
    ("\n", ("empty", "")), ("\r\n", ("empty", "")), (" /exit\n", ("message", " /exit")),
    ("/exit now\n", ("message", "/exit now")), ("hello  \n", ("message", "hello  ")),
])
def test_classify_line(line, want):
    assert classify_line(line) == want


def test_output_lines():
    assert chat.HELP_LINES == ("/help  show commands", "/reset clear this conversation",
                               "/exit  leave chat")
    assert chat.banner_line(104, 4096, False, ChatOptions()) == \
        "  XTML prompt: 104 ids, generation limit 4096, greedy, thinking_effort=max"
    assert chat.banner_line(37, 10, True, ChatOptions(thinking=False)) == \
        "  XTML prompt: 37 ids, generation limit 10, temperature/top-p sampling, thinking off"
    assert chat.progress_line(3, 4096, 17374, 12.4) == "chat: token 3/4096 id 17374 (12 s)"
    assert chat.turn_end_line(EOM, CTL) == "chat: turn ended by <|end_of_msg|> (163586)"
    assert chat.turn_end_line(EOS, CTL) == "chat: turn ended by [EOS] (163585)"
    assert chat.reply_text("", "A", True) == "<think></think>\n<response>A</response>\n"
    assert chat.reply_text(None, "A", False) == "<response>A</response>\n"


# --------------------------------------------------------------------------- real tokenizers


def _tokenizer_module():
    try:
        from k3engine import tokenizer
    except ImportError as e:
        pytest.skip(f"k3engine.tokenizer not importable: {e}")
    return tokenizer


def _check_with_real_tokenizer(tkm, tok):
    ctl = tkm.control_ids(tok, None)
    # §9.7: typed control text stays text; the only end ids close the effort and user messages.
    literal = [Message("user", "literal <|end_of_msg|> <|open|>")]
    inject = encode_prompt(tok, render_segments(literal))
    assert inject.count(ctl.end_of_msg) == 2
    # Control segments are single added ids; text segments never produce one.
    h = [Message("system", "You are helpful."),
         Message("user", "literal <|end_of_msg|> <|open|>")]
    segs = render_segments(h)
    ids = encode_prompt(tok, segs)
    ctl_ids = {ctl.open, ctl.close, ctl.sep, ctl.end_of_msg}
    by_name = {"<|open|>": ctl.open, "<|close|>": ctl.close, "<|sep|>": ctl.sep,
               "<|end_of_msg|>": ctl.end_of_msg}
    assert [i for i in ids if i in ctl_ids] == [by_name[t] for k, t in segs if k == "ctl"]
    # Each run of text ids between control ids decodes to the concatenated text segments.
    runs, cur, texts, tcur = [], [], [], ""
    for i in ids:
        if i in ctl_ids:
            runs.append(cur)
            cur = []
        else:
            cur.append(i)
    for k, t in segs:
        if k == "ctl":
            texts.append(tcur)
            tcur = ""
        else:
            tcur += t
    assert [tok.decode(r).decode() for r in runs] == texts
    # A generated turn in this vocabulary parses back to its text, with either end id.
    for end in ctl.end_ids:
        t = lambda s: tok.encode(s, False)  # noqa: E731
        gen = (t("Let me see.") + [ctl.close] + t("think") + [ctl.sep, ctl.open] + t("response")
               + [ctl.sep] + t("Paris.") + [ctl.close] + t("response") + [ctl.sep, ctl.close]
               + t("message") + [ctl.sep, end])
        assert parse_reply(tok, ctl, gen, True) == ("Let me see.", "Paris.")
    return ids


def test_with_our_shipped_tokenizer():
    tkm = _tokenizer_module()
    d = tkm.default_tokenizer_dir()
    if not (pathlib.Path(d) / "tiktoken.model").is_file():
        pytest.skip(f"our vocabulary is not shipped yet ({d} has no tiktoken.model)")
    tok = tkm.Tokenizer.from_dir(d)
    ids = _check_with_real_tokenizer(tkm, tok)
    print(f"[gate] chat with our vocabulary: {len(ids)} ids, control structure and parse ok")


def test_official_vectors_with_released_tokenizer():
    d = os.environ.get("K3_TOK_FILES")
    if not d:
        pytest.skip("NOT RUN: set K3_TOK_FILES to a directory holding the released "
                    "tiktoken.model + tokenizer_config.json to check the §9.7 ids")
    tkm = _tokenizer_module()
    tok = tkm.Tokenizer.from_dir(d)
    ctl = tkm.control_ids(tok, None)
    assert (ctl.end_of_msg, ctl.eos) == (EOM, EOS)
    for history, opts, want in [(H_HELLO, ChatOptions(), V_DEFAULT),
                                (H_HELLO, ChatOptions(effort="low"), V_LOW),
                                (H_HELLO, ChatOptions(thinking=False), V_NOTHINK),
                                (H_NUMBERS, ChatOptions(thinking=False), V_NOTHINK_TURNS)]:
        assert encode_prompt(tok, render_segments(history, opts)) == want
    assert [tok.encode(w, False) for w in ("message", "think", "response")] == \
        [[2778], [39964], [12092]]
    _check_with_real_tokenizer(tkm, tok)
    print("[gate] chat §9.7: 4/4 official id vectors match with the released tokenizer")
