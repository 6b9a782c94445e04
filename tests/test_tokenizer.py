"""Tokenizer (SYSTEM §8): strict loading, the Kimi pattern, specials, decoding, streaming,
our own shipped vocabulary and its trainer; parity with the real Kimi files when available."""
from __future__ import annotations

import ast
import base64
import json
import os
import pathlib

import pytest
import regex
import tiktoken

from k3engine import tokenizer as tk
from k3engine.tokenizer import (KIMI_PAT_ALTERNATIVES, KIMI_PAT_STR, StreamDecoder, Tokenizer,
                                TokenizerError, control_ids, default_tokenizer_dir)
from k3engine.tools import train_vocab


@pytest.fixture(autouse=True)
def _no_tiktoken_downloads(tmp_path, monkeypatch):
    # Nothing here may use tiktoken's download cache; point it at an empty private dir.
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "tiktoken_cache"))


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_dir(default_tokenizer_dir())


def via_file(tmp_path: pathlib.Path, text: str, name: str = "case.txt") -> tuple[str, bytes]:
    """Every case goes through a UTF-8 file, never argv (§8.7); CRLF must survive."""
    p = tmp_path / name
    p.write_bytes(text.encode("utf-8"))
    raw = p.read_bytes()
    return raw.decode("utf-8"), raw


# ----------------------------------------------------------------------------- round trips

ROUND_TRIP_CASES = {
    "ascii": "The capital of France is Paris.",
    "spaces": "  leading, trailing  and  double  spaces  ",
    "whitespace_runs": "a" + " " * 17 + "b\t\t\tc \t \n \n\n\n   \t",
    "crlf": "line one\r\nline two\r\n\r\nline four\r\n",
    "lone_cr": "old\rmac\r\rstyle",
    "han": "中华人民共和国成立于1949年。长江全长约6300公里。",
    "han_ascii": "GPU加速和CPU推理abc中文def",
    "japanese": "東京から大阪まで新幹線で約2時間30分です。カタカナ、ひらがな。",
    "korean": "대한민국의 수도는 서울입니다. 한글은 자음 14개와 모음 10개!",
    "arabic": "مرحبا، كيف حالك؟ السنة العادية ٣٦٥ يوما. اَلْعِلْمُ نُورٌ",
    "russian": "Съешь же ещё этих мягких французских булок, да выпей чаю.",
    "greek": "Η πρωτεύουσα της Ελλάδας είναι η Αθήνα. ΑΛΦΑΒΗΤΟ ω² = k/m",
    "hindi": "भारत की राजधानी नई दिल्ली है। कीमत: ₹१,२५०।",
    "emoji": "Great 👍🏽 job 🎉🎉 ok",
    "emoji_zwj": "👨‍👩‍👧‍👦 🏳️‍🌈 🧑‍🤝‍🧑 ❤️‍🔥 🇫🇷🇯🇵 1️⃣",
    "c_code": "int main(void) {\n    printf(\"%d\\n\", x->y[3]);\n    return 0; /* done */\n}\n",
    "python_code": "def f(x: int) -> str:\n\tif x >= 10:\n\t\treturn f\"{x!r:>8}\"\n    return ''\n",
    "json": '{"a": [1, 2.5e-3, null, true], "b": {"c": "d\\u00e9"}, "e": ""}',
    "markdown": "# Title\n\n- [x] item **bold** _it_ `code`\n\n| a | b |\n|---|---|\n",
    "url_path": "https://example.com/a/b?q=1&r=%20#x C:\\Users\\me\\file.txt",
    "contractions": "I'm sure they'll say we've done what you'd've DONE'S It'S",
    "camel_snake": "camelCaseName snake_case_name SCREAMING_CASE HTTPServer",
    "digits": "1234567890 3.14159 1,000,000 0x1F 2026-03-14T08:15:00Z",
    "punctuation_soup": "!!!???...,,,;;;:::---___===+++***&&&^^^%%%$$$###@@@",
    "typography": "“quotes” ‘single’ «guillemets» en–dash em—dash …",
    "math": "∀x∈ℝ: x² ≥ 0, ∑ᵢ aᵢ ≈ ∞ ≠ √2 ± ½",
    "latin1_high": "àáâãäåæçèéêëìíîïðñòóôõöøùúûüýþÿ ß ¡¿",
    "control_chars": "nul\x00bel\x07esc\x1b[0m del\x7f",
    "specials_literal": "<|open|>user<|sep|>hi<|end_of_msg|>[EOS] <|reserved_token_77|>",
    "mixed": "Hello世界! Привет мир 🌍 مرحبا 안녕 こんにちは 123",
    "single_char": "x",
    "lone_space": " ",
}


@pytest.mark.parametrize("name", sorted(ROUND_TRIP_CASES))
def test_round_trip_through_file(tok, tmp_path, name):
    text, raw = via_file(tmp_path, ROUND_TRIP_CASES[name])
    for allow in (False, True):
        ids = tok.encode(text, allow_special=allow)
        assert ids and all(0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == raw, f"{name} allow_special={allow}"


def test_round_trip_of_the_whole_corpus(tok):
    # Larger inputs than the cases: every corpus file decodes back to identical bytes.
    for f in train_vocab.corpus_files(train_vocab.DEFAULT_CORPUS):
        raw = f.read_bytes()
        assert tok.decode(tok.encode(raw.decode("utf-8"), allow_special=True)) == raw, f.name


def test_empty_text(tok):
    assert tok.encode("", allow_special=True) == [] == tok.encode("", allow_special=False)
    assert tok.decode([]) == b""


# ----------------------------------------------------------------------------- pattern (§8.4)

def test_pattern_is_the_join_of_the_eight_alternatives():
    assert len(KIMI_PAT_ALTERNATIVES) == 8
    assert KIMI_PAT_STR == "|".join(KIMI_PAT_ALTERNATIVES)
    assert KIMI_PAT_ALTERNATIVES[0] == r"[\p{Han}]+"
    assert KIMI_PAT_ALTERNATIVES[4].startswith(" ?")  # the fifth begins with a literal space
    assert KIMI_PAT_ALTERNATIVES[7] == r"\s+"


# Each alternative in its own named group, so a match tells which one produced it. (?-f): V1
# would otherwise use full case-folding; the Rust regex in tiktoken folds simply.
_NAMED = regex.compile("(?-f)" + "|".join(f"(?P<a{i}>{alt})"
                                            for i, alt in enumerate(KIMI_PAT_ALTERNATIVES, 1)),
                       regex.V1)


def regex_pieces(text: str) -> list[tuple[str, int]]:
    return [(m.group(), int(m.lastgroup[1:])) for m in _NAMED.finditer(text)]


def tiktoken_pieces(text: str) -> list[str]:
    """The pieces tiktoken's own (Rust) pre-tokenizer cuts: with every substring of the text in
    the vocabulary, each piece is a whole vocabulary entry and so comes out as one id."""
    ranks = {bytes([b]): b for b in range(256)}
    for s in sorted({text[i:j].encode() for i in range(len(text))
                     for j in range(i + 1, len(text) + 1)}):
        ranks.setdefault(s, len(ranks))
    enc = tiktoken.Encoding("pieces", pat_str=KIMI_PAT_STR, mergeable_ranks=ranks, special_tokens={})
    return [enc.decode_single_token_bytes(i).decode("utf-8") for i in enc.encode_ordinary(text)]


# (text, expected pieces with the 1-based alternative that matched each)
PATTERN_CASES = [
    ("中文abc", [("中文", 1), ("abc", 2)]),
    (" 中", [(" ", 8), ("中", 1)]),
    ("Hello world's", [("Hello", 2), (" world's", 2)]),
    ("don'T", [("don'T", 2)]),
    ("NASA'S HTTP", [("NASA'S", 3), (" HTTP", 3)]),
    ("12345", [("123", 4), ("45", 4)]),
    ("a, b!!\n\nc", [("a", 2), (",", 5), (" b", 2), ("!!\n\n", 5), ("c", 2)]),
    ("a\n\n  \nb", [("a", 2), ("\n\n  \n", 6), ("b", 2)]),
    ("x\r\n\r\ny", [("x", 2), ("\r\n\r\n", 6), ("y", 2)]),
    ("a   b", [("a", 2), ("  ", 7), (" b", 2)]),
    ("tab\there  ", [("tab", 2), ("\there", 2), ("  ", 7)]),
    ("a 1", [("a", 2), (" ", 8), ("1", 4)]),
]


@pytest.mark.parametrize("text,expected", PATTERN_CASES)
def test_pattern_pieces(text, expected):
    assert regex_pieces(text) == expected
    assert tiktoken_pieces(text) == [p for p, _ in expected]


def test_every_alternative_is_exercised():
    hit = {alt for _, pieces in PATTERN_CASES for _, alt in pieces}
    assert hit == set(range(1, 9))


def test_encode_respects_piece_boundaries(tok):
    # BPE never merges across pieces: the decoded ids regroup exactly into the pieces.
    text = "NASA'S 中文abc 12345 a, b!!\n\nc   d 1"
    ids = tok.encode(text, allow_special=False)
    boundaries = set()
    pos = 0
    for piece in tiktoken_pieces(text):
        pos += len(piece.encode())
        boundaries.add(pos)
    ends, pos = set(), 0
    for i in ids:
        pos += len(tok.decode([i]))
        ends.add(pos)
    assert boundaries <= ends


# ----------------------------------------------------------------------------- specials (§8.3)

def test_specials_allowed_and_disallowed(tok, tmp_path):
    text, raw = via_file(tmp_path, "<|open|>user<|sep|>hi [EOS]<|end_of_msg|>")
    ids = tok.encode(text, allow_special=True)
    ctl = control_ids(tok, None)
    assert ids[0] == ctl.open and ctl.sep in ids and ids[-2:] == [ctl.eos, ctl.end_of_msg]
    assert tok.decode(ids) == raw

    plain = tok.encode(text, allow_special=False)
    assert not set(plain) & set(tok.added)  # literal <|open|> stays text
    assert tok.decode(plain) == raw
    literal = tok.encode("<|open|>", allow_special=False)
    assert len(literal) > 1 and ctl.open not in literal and tok.decode(literal) == b"<|open|>"


def test_allowed_specials_agree_with_tiktoken_oracle(tok):
    # The §8.7 oracle encodes with all specials allowed; without overlapping specials the two agree.
    oracle = tiktoken.Encoding("oracle", pat_str=KIMI_PAT_STR,
                               mergeable_ranks=tk.load_ranks(tok.model_path),
                               special_tokens={c: i for i, c in tok.added.items()})
    for text in ROUND_TRIP_CASES.values():
        assert tok.encode(text, allow_special=True) == oracle.encode(text, allowed_special="all")


def _small_tokenizer(added: dict[int, str]) -> Tokenizer:
    return Tokenizer({bytes([b]): b for b in range(256)}, added)


def test_longest_special_at_earliest_position():
    t = _small_tokenizer({300: "<|a|>", 301: "<|a|>b", 302: "|>b"})
    assert t.encode("x<|a|>by", allow_special=True) == [ord("x"), 301, ord("y")]
    assert t.encode("x<|a|>y", allow_special=True) == [ord("x"), 300, ord("y")]
    # The earliest match wins even when a longer one starts later ("|>b" inside "<|a|>b").
    assert t.encode("<|a|>b|>b", allow_special=True) == [301, 302]
    assert t.encode("x<|a|>by", allow_special=False) == list(b"x<|a|>by")


def test_decode_added_tokens_and_unknown_ids(tok):
    ctl = control_ids(tok, None)
    hi = tok.encode("hi", allow_special=False)
    assert tok.decode([ctl.eos]) == b"[EOS]"
    assert tok.decode([ctl.open, *hi, -1, tok.vocab_size, 10**9, ctl.close]) == b"<|open|>hi<|close|>"
    assert tok.decode([3, 4, 5, 6, 7]) == b"$%&'("  # GPT-2 byte order, as in Kimi (§8.6)


# ----------------------------------------------------------------------------- streaming (§8.5)

def _single_byte_id(tok: Tokenizer, b: int) -> int:
    return next(i for i in range(256) if tok.decode([i]) == bytes([b]))


def test_stream_decoder_holds_back_split_code_points(tok):
    # "€" is E2 82 AC and "👍" F0 9F 91 8D: feed them one single-byte id at a time.
    sd = StreamDecoder(tok)
    deltas = [sd.push(_single_byte_id(tok, b)) for b in "€👍".encode()]
    assert deltas == ["", "", "€", "", "", "", "👍"]
    assert sd.flush() == ""


def test_stream_decoder_on_real_token_boundaries(tok):
    text = "Emoji 👨‍👩‍👧‍👦 and 𝄞 and 中文 and Ελληνικά 🎉"
    ids = tok.encode(text, allow_special=False)
    # The case is only meaningful if some token really ends inside a character.
    pieces = [tok.decode([i]) for i in ids]
    assert any(_is_split(p) for p in pieces), "no token splits a code point; pick another case"
    sd = StreamDecoder(tok)
    deltas = [sd.push(i) for i in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) + sd.flush() == text


def _is_split(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return False
    except UnicodeDecodeError:
        return True


def test_stream_decoder_bytes_and_flush():
    sd = StreamDecoder()
    data = "añ中🙂".encode()
    out = "".join(sd.feed(data[i:i + 1]) for i in range(len(data)))
    assert out == "añ中🙂"
    assert sd.feed(b"ok\xe4\xb8") == "ok"        # incomplete tail held back ...
    assert sd.flush() == "\ufffd"               # ... and shown as one U+FFFD at the end
    assert sd.feed(b"\xff") == "\ufffd"          # never-valid bytes are replaced at once
    with pytest.raises(TypeError):
        sd.push(5)


# ----------------------------------------------------------------------------- strict loading

def _vocab_lines(extra: list[bytes] = ()) -> list[bytes]:
    lines = [base64.b64encode(bytes([b])) + b" " + str(b).encode() for b in range(256)]
    return lines + list(extra)


def _write(d: pathlib.Path, lines: list[bytes] | None = None, config: str | None = None,
           sep: bytes = b"\n") -> pathlib.Path:
    d.mkdir(parents=True, exist_ok=True)
    if lines is not None:
        (d / "tiktoken.model").write_bytes(sep.join(lines) + sep)
    if config is None:
        first = sum(1 for x in lines or () if x.strip())    # ids ranks + index (§8.1)
        config = json.dumps({"added_tokens_decoder": {
            str(first + i): {"content": n, "special": True}
            for i, n in enumerate(("[BOS]", "[EOS]", "<|end_of_msg|>", "<|open|>", "<|close|>", "<|sep|>"))}})
    (d / "tokenizer_config.json").write_text(config, encoding="utf-8")
    return d


def test_small_valid_directory_loads(tmp_path):
    t = Tokenizer.from_dir(_write(tmp_path / "v", _vocab_lines([b"aGk= 256"])))
    assert (t.n_ranks, t.max_rank, t.vocab_size, len(t.added)) == (257, 256, 263, 6)
    assert t.encode("hi", allow_special=False) == [256]
    assert t.report_line() == "[TOK] 257 ranks (max id 256) + 6 added tokens | kimi=1 rankbpe=1"


def test_crlf_and_blank_lines_are_tolerated(tmp_path):
    lines = _vocab_lines([b"aGk= 256"])
    lines[10:10] = [b"", b"   "]
    crlf = Tokenizer.from_dir(_write(tmp_path / "crlf", lines, sep=b"\r\n"))
    lf = Tokenizer.from_dir(_write(tmp_path / "lf", _vocab_lines([b"aGk= 256"])))
    assert tk.load_ranks(crlf.model_path) == tk.load_ranks(lf.model_path)


MODEL_REFUSALS = [
    # (extra line appended after the 256 byte lines -> line 257, expected message tail)
    (b"QQ*= 300", r"tiktoken.model:257: character '\*' outside the base64 alphabet"),
    (b"QUJD\xc3\xa9 300", r"tiktoken.model:257: character .* outside the base64 alphabet"),
    (b"QQ=A 300", r"tiktoken.model:257: base64 data after '=' padding"),
    (b"QUJDR 300", r"tiktoken.model:257: truncated base64"),
    (b"A" * 684 + b" 300", r"tiktoken.model:257: base64 field of 684 characters exceeds 682"),
    (b"QUJD", r"tiktoken.model:257: line has no space"),
    (b"QUJD 12a", r"tiktoken.model:257: rank '12a' is not a decimal integer"),
    (b"QUJD -1", r"tiktoken.model:257: rank '-1' is not a decimal integer"),
    (b"QUJD +7", r"tiktoken.model:257: rank '\+7' is not a decimal integer"),
    (b"QUJD ", r"tiktoken.model:257: rank '' is not a decimal integer"),
    (b"QUJD 163840", r"tiktoken.model:257: rank 163840 outside \[0, 163840\)"),
    (b"QUJD " + b"9" * 5000, r"tiktoken.model:257: rank 9{20}\.\.\. outside \[0, 163840\)"),
    (b"QUJD 17", r"tiktoken.model:257: duplicate rank 17 \(first on line 18\)"),
    (b"QQ== 300", r"tiktoken.model:257: duplicate token bytes b'A' \(first on line 66\)"),
    (b" 300", r"tiktoken.model:257: empty token"),
]


@pytest.mark.parametrize("line,message", MODEL_REFUSALS)
def test_model_refusals(tmp_path, line, message):
    d = _write(tmp_path / "v", _vocab_lines([line]))
    with pytest.raises(TokenizerError, match=message) as e:
        Tokenizer.from_dir(d)
    assert str(d / "tiktoken.model") in str(e.value)


def test_leading_zeros_and_padding_variants_are_accepted(tmp_path):
    # Decoding stops at the first '=' (§8.1): missing or extra padding is not an error.
    t = Tokenizer.from_dir(_write(tmp_path / "v", _vocab_lines([b"aGk 000256", b"aGV5=== 257"])))
    assert t.decode([256, 257]) == b"hihey"


def test_longest_plausible_field_is_accepted(tmp_path):
    token = bytes(range(256)) * 2  # 512 bytes -> 684 chars: too long; 510 bytes -> 680: fine
    ok = base64.b64encode(token[:510])
    assert len(ok) <= 682
    t = Tokenizer.from_dir(_write(tmp_path / "v", _vocab_lines([ok + b" 256"])))
    assert t.decode([256]) == token[:510]


@pytest.mark.parametrize("content,message", [
    (b"", r"tiktoken.model: no rank lines"),
    (b"\n\r\n  \n", r"tiktoken.model: no rank lines"),
])
def test_empty_model_file(tmp_path, content, message):
    d = _write(tmp_path / "v")
    (d / "tiktoken.model").write_bytes(content)
    with pytest.raises(TokenizerError, match=message):
        Tokenizer.from_dir(d)


def test_missing_single_byte_is_refused(tmp_path):
    lines = _vocab_lines()
    del lines[0x41]
    with pytest.raises(TokenizerError, match=r"tiktoken.model: 1 single byte\(s\) have no rank \(0x41\)"):
        Tokenizer.from_dir(_write(tmp_path / "v", lines))


def test_missing_files_and_dir(tmp_path):
    with pytest.raises(TokenizerError, match=r"nowhere: tokenizer directory not found"):
        Tokenizer.from_dir(tmp_path / "nowhere")
    d = _write(tmp_path / "v", _vocab_lines())
    (d / "tokenizer_config.json").unlink()
    with pytest.raises(TokenizerError, match=r"tokenizer_config.json: tokenizer file not found"):
        Tokenizer.from_dir(d)
    d = _write(tmp_path / "w")  # config only
    with pytest.raises(TokenizerError, match=r"tiktoken.model: tokenizer file not found"):
        Tokenizer.from_dir(d)


CONFIG_REFUSALS = [
    ('{\n "added_tokens_decoder": {\n  "300": {"content": "[BOS]",}\n }\n}',
     r"tokenizer_config.json:3: invalid JSON"),
    ("[1, 2]", r"tokenizer_config.json: top level is not a JSON object"),
    ('{"bos_token": "[BOS]"}', r"tokenizer_config.json: missing added_tokens_decoder"),
    ('{"added_tokens_decoder": []}', r"tokenizer_config.json: added_tokens_decoder is not an object"),
    ('{"added_tokens_decoder": {\n"x1": {"content": "[BOS]"}}}',
     r"tokenizer_config.json:2: added_tokens_decoder key 'x1' is not a decimal id"),
    ('{"added_tokens_decoder": {"-5": {"content": "[BOS]"}}}',
     r"tokenizer_config.json:1: added_tokens_decoder key '-5' is not a decimal id"),
    ('{"added_tokens_decoder": {"163840": {"content": "[BOS]"}}}',
     r"tokenizer_config.json:1: added token id 163840 outside \[0, 163840\)"),
    ('{"added_tokens_decoder": {\n"300": {"content": "[BOS]"},\n"301": {"special": true}}}',
     r"tokenizer_config.json:3: added token 301 has no content"),
    ('{"added_tokens_decoder": {"300": {"content": 5}}}',
     r"tokenizer_config.json:1: added token 300 content is not a non-empty string"),
    ('{"added_tokens_decoder": {"300": {"content": "x", "special": "yes"}}}',
     r"tokenizer_config.json:1: added token 300 'special' is not true/false"),
    ('{"added_tokens_decoder": {"300": {"content": "x"},\n"301": {"content": "x"}}}',
     r"tokenizer_config.json:2: added token 301 repeats the content 'x' of id 300"),
    ('{"added_tokens_decoder": {"300": {"content": "x"}, "300": {"content": "y"}}}',
     r"tokenizer_config.json: invalid JSON: duplicate key '300'"),
    ('{"added_tokens_decoder": {"65": {"content": "x"}}}',
     r"tokenizer_config.json: added token id 65 \('x'\) is also a rank in .*tiktoken.model"),
]


@pytest.mark.parametrize("config,message", CONFIG_REFUSALS)
def test_config_refusals(tmp_path, config, message):
    d = _write(tmp_path / "v", _vocab_lines(), config=config)
    with pytest.raises(TokenizerError, match=message) as e:
        Tokenizer.from_dir(d)
    assert str(d / "tokenizer_config.json") in str(e.value)


def test_config_not_utf8(tmp_path):
    d = _write(tmp_path / "v", _vocab_lines())
    (d / "tokenizer_config.json").write_bytes(b'{"added_tokens_decoder": {"300": {"content": "\xff"}}}')
    with pytest.raises(TokenizerError, match=r"tokenizer_config.json: not UTF-8"):
        Tokenizer.from_dir(d)


# ----------------------------------------------------------------------------- control ids

def test_control_ids_by_name(tmp_path):
    t = Tokenizer.from_dir(_write(tmp_path / "v", _vocab_lines()))
    ctl = control_ids(t, {"eos_token_id": 258})
    assert (ctl.bos, ctl.eos, ctl.end_of_msg, ctl.open, ctl.close, ctl.sep) == (256, 257, 258, 259, 260, 261)
    assert ctl.end_ids == (258, 257)
    assert control_ids(t, {"eos_token_id": 257}) == ctl
    assert control_ids(t, {"eos_token_id": [258, 257]}) == ctl
    assert control_ids(t, {}) == ctl
    for bad in (5, "258", True, [258, 7]):
        with pytest.raises(TokenizerError, match=r"config.json: eos_token_id .* is neither <\|end_of_msg\|> \(258\) nor \[EOS\] \(257\)"):
            control_ids(t, {"eos_token_id": bad})


def test_control_ids_missing_names(tmp_path):
    config = json.dumps({"added_tokens_decoder": {"256": {"content": "[BOS]"}, "257": {"content": "[EOS]"},
                                                  "258": {"content": "<|open|>"}}})
    t = Tokenizer.from_dir(_write(tmp_path / "v", _vocab_lines(), config=config))
    with pytest.raises(TokenizerError) as e:
        control_ids(t, None)
    msg = str(e.value)
    assert str(tmp_path / "v" / "tokenizer_config.json") in msg
    assert "<|end_of_msg|>, <|close|>, <|sep|>" in msg and "[BOS]" not in msg


# ----------------------------------------------------------------------------- shipped vocabulary

def test_shipped_vocabulary(tok):
    assert default_tokenizer_dir().is_dir()
    assert tok.n_ranks == train_vocab.DEFAULT_RANKS
    assert tok.vocab_size == tok.n_ranks + 256
    assert tok.report_line() == (f"[TOK] {tok.n_ranks} ranks (max id {tok.n_ranks - 1}) "
                                 "+ 256 added tokens | kimi=1 rankbpe=1")
    ctl = control_ids(tok, None)
    n = tok.n_ranks
    assert (ctl.bos, ctl.eos, ctl.end_of_msg, ctl.open, ctl.close, ctl.sep) == tuple(range(n, n + 6))
    assert tok.added[n + 6] == "<|reserved_token_6|>" and tok.added[n + 255] == "<|reserved_token_255|>"
    assert tok.id_of("<|sep|>") == n + 5 and tok.id_of("nope") is None
    cfg = json.loads((default_tokenizer_dir() / "tokenizer_config.json").read_text())
    assert (cfg["bos_token"], cfg["eos_token"]) == ("[BOS]", "[EOS]")
    assert all(v == {"content": tok.added[int(k)], "special": True}
               for k, v in cfg["added_tokens_decoder"].items())


def test_shipped_vocabulary_is_rank_bpe(tok):
    ranks = tk.load_ranks(default_tokenizer_dir() / "tiktoken.model")
    by_rank = sorted(ranks, key=ranks.__getitem__)
    assert sorted(ranks.values()) == list(range(len(ranks)))
    assert by_rank[:256] == [bytes([b]) for b in train_vocab.byte_order()]
    # Every later rank is the concatenation of two earlier ones (the merge that made it).
    seen = set(by_rank[:256])
    for token in by_rank[256:]:
        assert any(token[:k] in seen and token[k:] in seen for k in range(1, len(token))), token
        seen.add(token)


def test_shipped_vocabulary_is_what_the_trainer_makes(tmp_path):
    # Committed files == trainer(committed corpus): the vocabulary is reproducible, not hand-edited.
    assert train_vocab.main([str(tmp_path / "out")]) == 0
    for name in ("tiktoken.model", "tokenizer_config.json"):
        assert (tmp_path / "out" / name).read_bytes() == (default_tokenizer_dir() / name).read_bytes(), name


def test_trainer_is_deterministic(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text(ROUND_TRIP_CASES["mixed"] * 3 + ROUND_TRIP_CASES["c_code"] * 4)
    (corpus / "b.txt").write_text(ROUND_TRIP_CASES["han"] * 3 + ROUND_TRIP_CASES["python_code"] * 4
                                  + "the quick brown fox jumps over the lazy dog\n" * 5)
    outs = [tmp_path / "one", tmp_path / "two"]
    for out in outs:
        assert train_vocab.main([str(out), "--ranks", "300", "--corpus", str(corpus)]) == 0
    for name in ("tiktoken.model", "tokenizer_config.json"):
        assert (outs[0] / name).read_bytes() == (outs[1] / name).read_bytes()
    t = Tokenizer.from_dir(outs[0])
    assert (t.n_ranks, t.vocab_size) == (300, 556)
    assert control_ids(t, None).bos == 300
    text = (corpus / "a.txt").read_text()
    assert t.decode(t.encode(text, allow_special=True)) == text.encode()


def test_trainer_reports_an_exhausted_corpus(tmp_path, capsys):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("abab")
    assert train_vocab.main([str(tmp_path / "out"), "--ranks", "1000", "--corpus", str(corpus)]) == 1
    assert "corpus exhausted" in capsys.readouterr().err


def test_trainer_tie_break_lowest_pair_bytes():
    # "ab" and "cd" are equally frequent: the lower bytes merge first; then "abab" beats "cdcd".
    vocab = train_vocab.train({b"abab": 2, b"cdcd": 2}, 260)
    assert vocab[256:] == [b"ab", b"cd", b"abab", b"cdcd"]


# ----------------------------------------------------------------------------- real Kimi files

def _kimi_dir() -> pathlib.Path:
    d = os.environ.get("K3_TOK_FILES")
    files = ("tiktoken.model", "tokenizer_config.json", "tokenization_kimi.py")
    if not d or not all((pathlib.Path(d) / f).is_file() for f in files):
        pytest.skip("NOT RUN: K3_TOK_FILES not set; the real Kimi tokenizer files are not available here")
    return pathlib.Path(d)


def _pat_str_from_source(path: pathlib.Path) -> str:
    """`pat_str` of tokenization_kimi.py, a `"|".join([...raw strings...])`, read with ast (never retyped)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "join" and isinstance(node.func.value, ast.Constant)
                and node.func.value.value == "|" and node.args
                and isinstance(node.args[0], (ast.List, ast.Tuple))):
            return "|".join(ast.literal_eval(node.args[0]))
    raise AssertionError(f"{path}: no '|'.join([...]) pattern found")


PARITY_CASES = [
    "Hello world", " leading", "trailing ", "double  space", "tab\tsep", "new\nline", "crlf\r\nline",
    "a" + " " * 17 + "b", "1234567890", "abc123def456", "!!??..,,;;::", "I'm you're they'll we've he'd it's",
    "NASA HTTP API", "camelCaseWord", "snake_case_word", "中文", "GPU中文", "中文GPU",
    "我们今天去公园散步吧。", "价格是128元", "東京は日本の首都です。", "안녕하세요 세계", "Привет, мир!",
    "مرحبا بالعالم", "Γειά σου κόσμε", "café naïve résumé", "😀😃😄", "emoji 🎉 text",
    "👨‍👩‍👧‍👦", "int main(void) { return 0; }", "def f(x):\n    return x * 2\n",
    '{"key": [1, 2, 3], "v": null}', "https://example.com/a?b=c", "C:\\Users\\me\\file.txt",
    "# Title\n\n- item\n", "aaaaaaaaaaaaaaaaaaaa", "Pneumonoultramicroscopicsilicovolcanoconiosis",
    "mixed 中文 and English и русский", " ", "x", "ÿþýüû", "∑∫√∞≈≠", "“quoted” ‘text’", "en–dash em—dash",
    "The capital of France is",
]


def _plain_ranks(path: pathlib.Path) -> dict[bytes, int]:
    # The oracle reads the file its own simple way, independent of our strict loader.
    return {base64.b64decode(tok): int(rank)
            for tok, rank in (line.split() for line in path.read_bytes().splitlines() if line.strip())}


def test_kimi_pattern_matches_tokenization_kimi_py():
    d = _kimi_dir()
    assert _pat_str_from_source(d / "tokenization_kimi.py") == KIMI_PAT_STR


def test_kimi_anchors_and_control_ids():
    d = _kimi_dir()
    t = Tokenizer.from_dir(d)
    assert t.report_line() == "[TOK] 163584 ranks (max id 163583) + 256 added tokens | kimi=1 rankbpe=1"
    assert t.vocab_size == 163_840
    assert t.encode("The capital of France is", allow_special=True) == [1008, 10484, 318, 15383, 387]
    assert t.decode([3, 4, 5, 6, 7]) == b"$%&'("
    assert t.decode([17374]) == b" Paris"
    for word, tid in (("message", 2778), ("think", 39964), ("response", 12092)):  # §9.7
        assert t.encode(word, allow_special=False) == [tid]
    config = json.loads((d / "config.json").read_text()) if (d / "config.json").is_file() else None
    ctl = control_ids(t, config)
    assert (ctl.bos, ctl.eos, ctl.end_of_msg, ctl.open, ctl.close, ctl.sep) == tuple(range(163584, 163590))
    assert ctl.end_ids == (163586, 163585)
    literal = t.encode("literal <|end_of_msg|> <|open|>", allow_special=False)
    assert 163586 not in literal and 163587 not in literal


def test_kimi_parity_with_tiktoken_oracle(tmp_path):
    d = _kimi_dir()
    t = Tokenizer.from_dir(d)
    oracle = tiktoken.Encoding("kimi-oracle", pat_str=_pat_str_from_source(d / "tokenization_kimi.py"),
                               mergeable_ranks=_plain_ranks(d / "tiktoken.model"),
                               special_tokens={v["content"]: int(k) for k, v in json.loads(
                                   (d / "tokenizer_config.json").read_text())["added_tokens_decoder"].items()})
    failures = []
    for n, case in enumerate(PARITY_CASES):
        text, raw = via_file(tmp_path, case, f"case{n}.txt")
        ours, want = t.encode(text, allow_special=True), oracle.encode(text, allowed_special="all")
        if ours != want:
            first = next((i for i, (a, b) in enumerate(zip(ours, want)) if a != b), min(len(ours), len(want)))
            failures.append(f"case {n} {case!r}: ours {ours} oracle {want} first divergence at {first}")
        assert t.decode(ours) == raw
    assert not failures, f"tokenizer parity: {len(PARITY_CASES) - len(failures)}/{len(PARITY_CASES)} " \
                         "cases match\n" + "\n".join(failures)
