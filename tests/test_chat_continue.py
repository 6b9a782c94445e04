"""Continue and forks on the demo model (Conversation): a stopped or limit-hit reply resumes
with exactly the ids of an uninterrupted turn, greedy and sampled; an edited earlier user
message reuses the state up to the edit, with the ids of a fresh session."""
from __future__ import annotations

import pytest

from engine_helpers import chat_on, load, run_turn
from k3engine.chat import ChatError, History, Message
from k3engine.generate import Cancel, GenSpec
from k3engine.sampler import Sampler
from k3engine.sequence import FORK_SNAPSHOT_BYTES
from k3engine.tokenizer import Tokenizer, control_ids
from k3engine.tools.make_checkpoint import dims_config, make_checkpoint



@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("demo") / "demo")
    make_checkpoint(d, dims_config("demo"), seed=3)
    tok = Tokenizer.from_dir(d)
    return load(d), tok, control_ids(tok, None)


def _session(demo, history, sampler=None):
    lm, tok, _ = demo
    return chat_on(lm, tok, history, sampler or Sampler.from_flags(greedy=True))


def G(n: int) -> GenSpec:
    return GenSpec(gen=n, thinking=False)


def _drive(steps, stop_after=None, cancel=None):
    """Run a turn/continue_turn generator; set `cancel` after `stop_after` ids."""
    def on_token(n, _id):
        if stop_after is not None and n == stop_after:
            cancel.set()
    return run_turn(steps, on_token)


@pytest.mark.parametrize("sampled", [False, True])
def test_stop_then_continue_gives_the_uninterrupted_ids(demo, sampled):
    mk = (lambda: Sampler.from_flags(temperature=0.8, top_p=0.9, seed=11)) if sampled else None
    n = 14
    whole = _session(demo, History([Message("user", "Tell me a story")]),
                     mk() if mk else None)
    want = run_turn(whole.turn(G(n)))
    assert want.end_id is None and len(want.ids) == n     # the random demo never closes

    chat = _session(demo, History([Message("user", "Tell me a story")]), mk() if mk else None)
    cancel = Cancel()
    first = _drive(chat.turn(G(n), cancel), stop_after=4, cancel=cancel)
    assert first.interrupted and len(first.ids) == 4 and chat.pending is not None
    second = _drive(chat.continue_turn(G(n - 4), Cancel()))
    print(f"[gate] stop after 4 + continue ({'sampled' if sampled else 'greedy'}): "
          f"{second.ids} vs uninterrupted {want.ids}")
    assert second.ids == want.ids and second.continued == 4


def test_limit_then_continue_gives_the_uninterrupted_ids(demo):
    want = run_turn(_session(demo, History([Message("user", "Count")])).turn(G(12)))
    chat = _session(demo, History([Message("user", "Count")]))
    part = run_turn(chat.turn(G(5)))
    assert not part.interrupted and len(part.ids) == 5
    rest = _drive(chat.continue_turn(G(7)))
    print(f"[gate] limit 5 + continue 7: {rest.ids} vs gen 12 {want.ids}")
    assert rest.ids == want.ids


def test_nothing_to_continue_is_refused(demo):
    chat = _session(demo, History([Message("user", "Hi")]))
    with pytest.raises(ChatError, match="no incomplete reply"):
        next(chat.continue_turn(G(3)))


def test_edit_of_an_earlier_message_forks_and_reuses_up_to_it(demo):
    lm, tok, ctl = demo
    h = History([Message("system", "Be brief."), Message("user", "First question")])
    chat = _session(demo, h)
    run_turn(chat.turn(G(3)))
    # close turn 1 by hand (the random demo never ends a reply), then a second turn
    h.add(Message("assistant", "An answer."))
    h.add(Message("user", "Second question"))
    chat.pending = None                     # the reply closed by hand replaces turn 1's
    t2 = run_turn(chat.turn(G(3)))
    # turn 2 forked from the snapshot before "First question" (the generated reply was
    # replaced, so the plain reuse could not apply), and kept one before "Second question"
    forks = chat.seq.forks
    assert t2.reused == forks[0][0] > 0
    pos2 = forks[-1][0]
    # edit the SECOND user message: everything before it is reused from the fork
    edited = History(list(h)[:-1] + [Message("user", "Second question, edited")])
    chat.replace_history(edited)
    fork = run_turn(chat.turn(G(6)))
    fresh = run_turn(_session(demo, History(list(edited))).turn(G(6)))
    print(f"[gate] fork: {fork.reused} of {fork.prompt_positions} positions reused; ids "
          f"{fork.ids} vs a fresh session {fresh.ids}")
    assert fork.reused == pos2 and fork.ids == fresh.ids
    assert sum(a.nbytes for _, s in chat.seq.forks for a in s) <= FORK_SNAPSHOT_BYTES
