"""Train our own byte-level rank-BPE vocabulary (DESIGN "Our vocabulary").

    python -m k3engine.tools.train_vocab OUT_DIR [--ranks N] [--corpus DIR]

The real Kimi vocabulary cannot be shipped, so the project makes a small one in the same file
format from a corpus kept in the repo (`vocab_corpus/`). The result is committed as package data
(`k3engine/data/tokenizer/`), so nothing is trained at install or start-up.

Rules (tiktoken "rank BPE", SYSTEM §8.3):
* ranks 0..255 are the 256 single bytes, in the GPT-2 byte-level order the Kimi vocabulary
  also uses (printable bytes first: rank 0 is '!', ranks 3..7 are `$%&'(`);
* every further rank is the concatenated bytes of the pair merged at that step, in merge order;
* merges never cross pre-tokenizer pieces (the Kimi pattern, §8.4);
* the most frequent adjacent pair wins; ties go to the lowest (left bytes, right bytes), so the
  output depends only on the corpus bytes.

The 256 added tokens sit at ids ranks + index: the six K3 control names at their K3 offsets,
the rest `<|reserved_token_N|>`.
"""
from __future__ import annotations

import argparse
import base64
import heapq
import json
import pathlib
import sys
import time
from collections import Counter

import regex  # a hard dependency of tiktoken; stdlib `re` has no \p{...} or class intersection

from k3engine.tokenizer import CONFIG_FILE, KIMI_PAT_STR, MODEL_FILE

DEFAULT_RANKS = 4000
DEFAULT_CORPUS = pathlib.Path(__file__).resolve().parent / "vocab_corpus"
N_ADDED = 256
CONTROL_NAMES = ("[BOS]", "[EOS]", "<|end_of_msg|>", "<|open|>", "<|close|>", "<|sep|>")
# A pair seen once is memorisation, not structure; stop rather than mint such ranks.
MIN_PAIR_COUNT = 2

# V1 is needed for the `&&` class intersections; (?-f) turns off V1's full case-folding so the
# contraction group `(?i:'s|...)` folds simply, like the Rust regex inside tiktoken.
_PRETOKENIZE = regex.compile("(?-f)" + KIMI_PAT_STR, regex.V1)


def byte_order() -> list[int]:
    """The 256 byte values in rank order (GPT-2 `bytes_to_unicode` order)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    rest = [b for b in range(256) if b not in set(printable)]
    return printable + rest


def corpus_files(corpus: pathlib.Path) -> list[pathlib.Path]:
    files = sorted((p for p in corpus.rglob("*") if p.is_file()),
                   key=lambda p: p.relative_to(corpus).as_posix())
    if not files:
        raise SystemExit(f"train_vocab: no corpus files under {corpus}")
    return files


def piece_counts(files: list[pathlib.Path]) -> Counter[bytes]:
    counts: Counter[bytes] = Counter()
    for f in files:
        # Bytes -> str without newline translation, so CRLF in the corpus stays CRLF.
        text = f.read_bytes().decode("utf-8")
        counts.update(p.encode("utf-8") for p in _PRETOKENIZE.findall(text))
    return counts


def train(counts: Counter[bytes], n_ranks: int) -> list[bytes]:
    """Token bytes in rank order: the 256 bytes, then up to n_ranks - 256 merges."""
    if n_ranks < 256:
        raise ValueError("a byte-level vocabulary needs at least 256 ranks")
    vocab: list[bytes] = [bytes([b]) for b in byte_order()]
    id_of = {tok: i for i, tok in enumerate(vocab)}

    words = [[id_of[bytes([b])] for b in piece] for piece in counts]
    freq = list(counts.values())
    pair_count: Counter[tuple[int, int]] = Counter()
    where: dict[tuple[int, int], set[int]] = {}
    for w, syms in enumerate(words):
        for pair in zip(syms, syms[1:]):
            pair_count[pair] += freq[w]
            where.setdefault(pair, set()).add(w)

    # Max-heap by count with lazy deletion: an entry is live only while its count is current.
    def entry(pair: tuple[int, int]) -> tuple:
        return (-pair_count[pair], vocab[pair[0]], vocab[pair[1]], pair)

    heap = [entry(p) for p in pair_count]
    heapq.heapify(heap)

    while len(vocab) < n_ranks and heap:
        neg, _, _, pair = heapq.heappop(heap)
        if pair_count.get(pair, 0) != -neg:
            continue
        if -neg < MIN_PAIR_COUNT:
            break
        merged = vocab[pair[0]] + vocab[pair[1]]
        # Two different pairs can concatenate to bytes that already have a rank; the merge
        # still applies but mints no duplicate rank (ranks must have unique bytes).
        new = id_of.get(merged)
        if new is None:
            new = len(vocab)
            vocab.append(merged)
            id_of[merged] = new
        touched: set[tuple[int, int]] = set()
        for w in sorted(where.pop(pair, ())):
            syms = words[w]
            if len(syms) < 2:
                continue
            for p in zip(syms, syms[1:]):
                pair_count[p] -= freq[w]
                touched.add(p)
            out, i = [], 0
            while i < len(syms):
                if i + 1 < len(syms) and syms[i] == pair[0] and syms[i + 1] == pair[1]:
                    out.append(new)
                    i += 2
                else:
                    out.append(syms[i])
                    i += 1
            words[w] = out
            for p in zip(out, out[1:]):
                pair_count[p] += freq[w]
                where.setdefault(p, set()).add(w)
                touched.add(p)
        for p in touched:
            if pair_count[p] > 0:
                heapq.heappush(heap, entry(p))
            else:
                del pair_count[p]
    return vocab


def added_tokens(n_ranks: int) -> dict[int, str]:
    names = [*CONTROL_NAMES, *(f"<|reserved_token_{i}|>" for i in range(len(CONTROL_NAMES), N_ADDED))]
    return {n_ranks + i: name for i, name in enumerate(names)}


def write_vocab(out_dir: pathlib.Path, vocab: list[bytes]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    lines = [f"{base64.b64encode(tok).decode('ascii')} {rank}\n" for rank, tok in enumerate(vocab)]
    (out_dir / MODEL_FILE).write_text("".join(lines), encoding="ascii", newline="\n")
    # One added token per line: small, diffable, and error messages can point at the line.
    entries = [f'  {json.dumps(str(i))}: {json.dumps({"content": c, "special": True})}'
               for i, c in added_tokens(len(vocab)).items()]
    config = ('{\n "added_tokens_decoder": {\n' + ",\n".join(entries) + "\n },\n"
              f' "bos_token": {json.dumps(CONTROL_NAMES[0])},\n'
              f' "eos_token": {json.dumps(CONTROL_NAMES[1])}\n}}\n')
    (out_dir / CONFIG_FILE).write_text(config, encoding="utf-8", newline="\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m k3engine.tools.train_vocab",
                                 description="Train the project's byte-level rank-BPE vocabulary.")
    ap.add_argument("out_dir", type=pathlib.Path)
    ap.add_argument("--ranks", type=int, default=DEFAULT_RANKS,
                    help=f"number of ranks including the 256 bytes (default {DEFAULT_RANKS})")
    ap.add_argument("--corpus", type=pathlib.Path, default=DEFAULT_CORPUS,
                    help="directory of UTF-8 text files (default: the corpus kept in the repo)")
    args = ap.parse_args(argv)
    if not 256 <= args.ranks <= 163_840 - N_ADDED:
        ap.error(f"--ranks must be in [256, {163_840 - N_ADDED}]")

    t0 = time.perf_counter()
    files = corpus_files(args.corpus)
    counts = piece_counts(files)
    vocab = train(counts, args.ranks)
    write_vocab(args.out_dir, vocab)
    seconds = time.perf_counter() - t0
    size = sum(f.stat().st_size for f in files)
    print(f"train_vocab: {len(files)} files, {size} bytes, {len(counts)} distinct pieces -> "
          f"{len(vocab)} ranks + {N_ADDED} added tokens (vocab {len(vocab) + N_ADDED}) "
          f"in {seconds:.2f} s -> {args.out_dir}", file=sys.stderr)
    if len(vocab) < args.ranks:
        print(f"train_vocab: corpus exhausted: only {len(vocab)} of {args.ranks} ranks have a pair "
              f"seen at least {MIN_PAIR_COUNT} times", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
