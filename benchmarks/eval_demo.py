"""Measure the shipped demo model on the ENGINE's greedy output (docs/demo-model.md).

    python benchmarks/eval_demo.py [--model DIR] [--prompts N] [--out docs/demo-model-results.json]

On held-out prompts (never in training; `demo_corpus` split by the prompt's crc32):
* the share of turns that end with an end id within 128 tokens (thinking off) and 256
  (thinking on), and of those the share whose reply parses (chat.parse_reply);
* the share of reply words (letters only, case folded) that are words of the training corpus;
* accuracy on the held-out templated questions with one right answer (the answer must appear
  as a whole word in the reply);
* three multi-turn transcripts, verbatim;
* expert usage per layer and the load balance on a ~1,000-token held-out trace (the engine's
  `--dump-cache-trace`), and the LRU hit curve of that trace from `k3 sim-cache`;
* with torch installed: the independent float64 PyTorch forward on the shipped files against
  the engine's teacher-forced logits (tolerance and argmax), as tests/test_demo_model.py.
Measured, not asserted.  Timings are not taken here.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter

import numpy as np

from k3engine.chat import History, Message
from k3engine.conversation import Conversation
from k3engine.engine import Engine, GenSpec
from k3engine.events import TurnEnded
from k3engine.loading import load_model, read_config
from k3engine.tokenizer import Tokenizer, control_ids
from k3engine.tools.demo import shipped_dir
from k3engine.tools.demo_corpus import corpus_words, make_corpus, words

GEN_OFF, GEN_ON = 128, 256


def load(model_dir):
    cfg, _ = read_config(model_dir)
    lm = load_model(model_dir, cfg)
    tok = Tokenizer.from_dir(model_dir)
    return lm, tok, control_ids(tok, None)


def greedy_turn(chat: Conversation, thinking: bool, gen: int):
    """One greedy turn's TurnSummary (a closed reply joins the history)."""
    res = None
    for ev in chat.turn(GenSpec(gen=gen, thinking=thinking)):
        if isinstance(ev, TurnEnded):
            res = ev.result
    return res


def one_turn(lm, tok, ctl, history, thinking, gen):
    r = greedy_turn(Conversation(Engine.around(lm, tok), history), thinking, gen)
    if r.malformed is not None:     # closed by an end id but malformed
        return dict(ended=True, parsed=False, error=r.malformed, n=None, content="",
                    reasoning="")
    return dict(ended=r.end_id is not None, parsed=r.end_id is not None, n=len(r.ids),
                content=r.content or "", reasoning=r.reasoning or "")


def answer_ok(answer: str, content: str) -> bool:
    return re.search(r"(?<![\w.])" + re.escape(answer) + r"(?![\w])", content, re.I) is not None


def held_out(seed, n):
    c = make_corpus(seed)
    return c, c.test[:n]


def chat_figures(lm, tok, ctl, corpus, convs):
    vocab = corpus_words(corpus)
    out = {}
    samples = []
    for thinking, gen in ((False, GEN_OFF), (True, GEN_ON)):
        ended = parsed = 0
        n_words = n_known = 0
        right = asked = 0
        unknown = Counter()
        lengths = []
        fam_right, fam_asked = Counter(), Counter()
        for conv in convs:
            t = conv.turns[0]
            h = History(([Message("system", conv.system)] if conv.system else [])
                        + [Message("user", t.user)])
            r = one_turn(lm, tok, ctl, h, thinking, gen)
            ended += r["ended"]
            parsed += r["parsed"]
            if r["n"] is not None and r["ended"]:
                lengths.append(r["n"])
            ws = words(r["content"] + " " + r["reasoning"])
            n_words += len(ws)
            n_known += sum(w in vocab for w in ws)
            unknown.update(w for w in ws if w not in vocab)
            if t.answer is not None:
                asked += 1
                ok = bool(r["parsed"] and answer_ok(t.answer, r["content"]))
                right += ok
                fam_asked[t.family] += 1
                fam_right[t.family] += ok
            if len(samples) < 12:
                samples.append(dict(thinking=thinking, user=t.user, answer=t.answer,
                                    reasoning=r["reasoning"], content=r["content"],
                                    ended=r["ended"]))
        key = "thinking_on" if thinking else "thinking_off"
        out[key] = dict(prompts=len(convs), gen_limit=gen, ended=ended, parsed=parsed,
                        ended_pct=round(100 * ended / len(convs), 1),
                        parsed_pct=round(100 * parsed / len(convs), 1),
                        reply_words=n_words, corpus_words=n_known,
                        corpus_words_pct=round(100 * n_known / max(1, n_words), 2),
                        unknown_words=unknown.most_common(10),
                        one_answer_questions=asked, right=right,
                        accuracy_pct=round(100 * right / max(1, asked), 1),
                        by_family={f: f"{fam_right[f]}/{n}" for f, n in sorted(fam_asked.items())},
                        mean_reply_ids=round(float(np.mean(lengths)), 1) if lengths else None)
    out["samples"] = samples
    return out


def transcripts(lm, tok, ctl, convs):
    """Three conversations of three held-out prompts each, one per setting."""
    settings = ((None, False), ("Be brief.", True), ("You are the K3 Studio demo model. "
                                                     "Answer briefly.", False))
    out = []
    for k, (system, thinking) in enumerate(settings):
        h = History([Message("system", system)] if system else [])
        chat = Conversation(Engine.around(lm, tok), h)
        turns = []
        for conv in convs[3 * k:3 * k + 3]:
            h.add(Message("user", conv.turns[0].user))
            r = greedy_turn(chat, thinking, GEN_ON if thinking else GEN_OFF)
            turns.append(dict(user=conv.turns[0].user, reasoning=r.reasoning, content=r.content,
                              ended=r.end_id is not None, reused=r.reused, ids=len(r.ids)))
            if r.end_id is None:
                h.remove_last()
                break
        out.append(dict(system=system, thinking=thinking, turns=turns))
    return out


def trace_figures(model_dir, tok, convs, cfg, n_tokens=1000):
    """A held-out chat prompt, then greedy decode to n_tokens positions in all (one token per
    step: the trace holds every decode step's routing), through the CLI with
    --dump-cache-trace; then k3 sim-cache on that trace."""
    from k3engine.chat import ChatOptions, encode_prompt, render_segments
    h = History([Message("user", convs[0].turns[0].user)])
    ids = encode_prompt(tok, render_segments(h, ChatOptions(thinking=True)))
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "ids.txt"), "w") as f:
            f.write(",".join(map(str, ids)))
        subprocess.run([sys.executable, "-m", "k3engine", model_dir, "--ids-file",
                        os.path.join(d, "ids.txt"), "--gen", str(n_tokens - len(ids)),
                        "--incremental",
                        "--dump-cache-trace", d, "--out", os.path.join(d, "run.json")],
                       check=True, capture_output=True)
        trace = os.path.join(d, "expert_trace.bin")
        pairs = np.fromfile(trace, dtype="<i4").reshape(-1, 2)
        run = json.load(open(os.path.join(d, "run.json"), "rb"))
        text = bytes(tok.decode(run["generated_ids"])).decode("utf-8", "replace")
        ebytes = 3 * cfg.moe_inter * (cfg.latent // 2 + cfg.latent // 32)
        slots = [17, 24, 32, 48, 64, 96, 128, 160, 192, 224]
        caps = ",".join(f"{s * ebytes / 1e9:.9f}" for s in slots)
        sim = subprocess.run([sys.executable, "-m", "k3engine", "sim-cache", trace,
                              "--capacities", caps, "--expert-bytes", str(ebytes)],
                             check=True, capture_output=True, text=True).stdout
    usage = {}
    for L in sorted(set(pairs[:, 0].tolist())):
        c = Counter(pairs[pairs[:, 0] == L, 1].tolist())
        counts = np.array([c.get(e, 0) for e in range(cfg.n_experts)], dtype=float)
        usage[int(L)] = dict(used=int((counts > 0).sum()), of=cfg.n_experts,
                             max_share_pct=round(float(100 * counts.max() / counts.sum()), 2),
                             min_share_pct=round(float(100 * counts.min() / counts.sum()), 2),
                             cv=round(float(counts.std() / counts.mean()), 3))
    return dict(prompt_ids=len(ids), decoded_ids=n_tokens - len(ids), requests=int(len(pairs)),
                usage=usage, decoded_text_head=text[:600],
                sim_cache=sim.splitlines())


def torch_check(model_dir, tok, convs):
    try:
        import torch
    except ImportError:
        return dict(skipped="torch is not installed (pip install -e '.[train]')")
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    from demo_check import compare_engine_torch
    return compare_engine_torch(model_dir, tok, convs[:4])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=shipped_dir())
    ap.add_argument("--prompts", type=int, default=60)
    ap.add_argument("--out", default=os.path.join("docs", "demo-model-results.json"))
    a = ap.parse_args(argv)
    seed = json.load(open(os.path.join(a.model, "training.json")))["seed"]
    lm, tok, ctl = load(a.model)
    corpus, convs = held_out(seed, a.prompts + 60)
    res = dict(model=os.path.basename(os.path.normpath(a.model)), seed=seed)
    res["chat"] = chat_figures(lm, tok, ctl, corpus, convs[:a.prompts])
    res["transcripts"] = transcripts(lm, tok, ctl, convs[a.prompts:a.prompts + 9])
    res["routing"] = trace_figures(a.model, tok, convs[a.prompts + 9:], lm.cfg)
    res["torch_float64"] = torch_check(a.model, tok, convs[a.prompts + 9:])
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps({k: v for k, v in res["chat"].items() if k != "samples"}, indent=1))
    print(json.dumps(res["torch_float64"], indent=1))
    for L, u in res["routing"]["usage"].items():
        print("layer", L, u)
    print("\n".join(res["routing"]["sim_cache"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
