"""The demo model's corpus: chat conversations and plain text the project writes itself.

Licence: every sentence here is written by this project (templates filled from small tables of
numbers, days, months and units, and facts about K3 Studio); it is part of the repository and
shares its licence (Apache-2.0). Nothing is taken from outside.

Deterministic from a seed.  Each conversation is a `Conversation` (optional system message,
one to three user/assistant turns, thinking on or off) that `conversation_ids` renders in the
engine's exact XTML chat format (`k3engine.chat.render_segments` with the whole history and
no generation prompt, then `encode_prompt`): that sequence is precisely "the prompt of the last
turn followed by the ids the model must generate", each reply closed by `<|end_of_msg|>`.

The held-out split is by the user message's text: a prompt whose crc32 falls in the test
residue never appears in any training conversation, so held-out prompts are new strings.
The facts behind them (the sum 7 + 5, the day after Monday, what the trunk is) are the
templates' own and do appear in training under other wordings and other numbers; the note
(docs/demo-model.md) says so.
"""
from __future__ import annotations

import random
import re
import zlib
from dataclasses import dataclass, field

DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
MONTHS = (("January", 31), ("February", 28), ("March", 31), ("April", 30), ("May", 31),
          ("June", 30), ("July", 31), ("August", 31), ("September", 30), ("October", 31),
          ("November", 30), ("December", 31))
NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine",
                "ten", "eleven", "twelve")
TEST_MOD = 8          # crc32(prompt) % TEST_MOD == 0 -> held out

SYSTEMS = (
    "You are a helpful assistant.",
    "You are the K3 Studio demo model. Answer briefly.",
    "Be brief.",
    "Answer in one sentence.",
    "You are a friendly assistant in K3 Studio.",
)
PREFIXES = ("", "", "", "Quick question: ", "Please tell me: ", "Hi! ", "Can you help? ",
            "I have a question. ")
SUFFIXES = ("", "", "", " Thanks!", " Thank you.", " Please answer briefly.")


@dataclass(frozen=True)
class Turn:
    user: str
    reasoning: str
    content: str
    answer: str | None = None        # the one right answer (a word or a number), if any
    family: str = ""


@dataclass
class Conversation:
    turns: list[Turn]
    system: str | None = None
    thinking: bool = True

    def history(self, upto: int | None = None):
        """The chat.History of the first `upto` turns, complete (user and assistant)."""
        from ..chat import History, Message
        h = History([Message("system", self.system)] if self.system else [])
        for t in self.turns[:upto]:
            h.add(Message("user", t.user))
            h.add(Message("assistant", t.content, t.reasoning))
        return h


@dataclass
class Corpus:
    train: list[Conversation] = field(default_factory=list)
    test: list[Conversation] = field(default_factory=list)
    plain: list[str] = field(default_factory=list)


def is_test_prompt(user: str) -> bool:
    return zlib.crc32(user.encode()) % TEST_MOD == 0


# ---- one-turn tasks: each returns (user core text, reasoning, content, answer) ----------

def _greet(r: random.Random):
    q = r.choice(("Hello!", "Hi there.", "Good morning!", "Hey, how are you?", "Hello, who are you?",
                  "Good evening.", "Hi! What can you do?", "Nice to meet you."))
    if "who" in q:
        return q, "The user asks who I am.", ("I am the K3 Studio demo model, a tiny model "
                                              "trained on a small corpus. I am not Kimi K3."), None
    if "can you do" in q:
        return q, "The user asks what I can do.", ("I can answer small questions: sums, days of "
                                                    "the week, unit conversions and K3 Studio."), None
    if "how are you" in q:
        return q, "The user greets me and asks how I am.", "I am fine, thank you. How can I help?", None
    return q, "The user greets me.", r.choice(("Hello! How can I help you today?",
                                               "Hi! What would you like to know?")), None


def _thanks(r: random.Random):
    q = r.choice(("Thanks!", "Thank you.", "Great, thanks.", "That helps, thank you.", "Bye!",
                  "Goodbye."))
    if q.startswith(("Bye", "Good")):
        return q, "The user says goodbye.", "Goodbye! Have a nice day.", None
    return q, "The user thanks me.", "You are welcome!", None


def _add(r: random.Random):
    a, b = r.randint(0, 12), r.randint(0, 12)
    q = r.choice((f"What is {a} plus {b}?", f"What is {a} + {b}?", f"Add {a} and {b}.",
                  f"How much is {a} plus {b}?", f"Compute {a} + {b}.", f"What do {a} and {b} add up to?"))
    s = a + b
    return q, f"{a} + {b} = {s}.", f"{a} plus {b} is {s}.", str(s)


def _sub(r: random.Random):
    a = r.randint(0, 20)
    b = r.randint(0, min(a, 10))
    q = r.choice((f"What is {a} minus {b}?", f"What is {a} - {b}?", f"Subtract {b} from {a}.",
                  f"How much is {a} minus {b}?"))
    return q, f"{a} - {b} = {a - b}.", f"{a} minus {b} is {a - b}.", str(a - b)


def _mul(r: random.Random):
    a, b = r.randint(1, 9), r.randint(1, 9)
    q = r.choice((f"What is {a} times {b}?", f"What is {a} x {b}?", f"Multiply {a} by {b}.",
                  f"How much is {a} times {b}?"))
    return q, f"{a} x {b} = {a * b}.", f"{a} times {b} is {a * b}.", str(a * b)


def _day_after(r: random.Random):
    i = r.randrange(7)
    d, n = DAYS[i], DAYS[(i + 1) % 7]
    if r.random() < 0.5:
        q = r.choice((f"What day comes after {d}?", f"Which day follows {d}?",
                      f"If today is {d}, what day is tomorrow?"))
        return q, f"The day after {d} is {n}.", f"The day after {d} is {n}.", n
    p = DAYS[(i - 1) % 7]
    q = r.choice((f"What day comes before {d}?", f"Which day is before {d}?",
                  f"If today is {d}, what day was yesterday?"))
    return q, f"The day before {d} is {p}.", f"The day before {d} is {p}.", p


def _day_plus(r: random.Random):
    i, k = r.randrange(7), r.randint(2, 6)
    d, n = DAYS[i], DAYS[(i + k) % 7]
    q = r.choice((f"If today is {d}, what day will it be in {k} days?",
                  f"What day is {k} days after {d}?"))
    steps = ", ".join(DAYS[(i + j) % 7] for j in range(1, k + 1))
    return q, f"Counting {k} days from {d}: {steps}.", f"{k} days after {d} it is {n}.", n


def _month(r: random.Random):
    i = r.randrange(12)
    m, days = MONTHS[i]
    if r.random() < 0.5:
        n = MONTHS[(i + 1) % 12][0]
        q = r.choice((f"What month comes after {m}?", f"Which month follows {m}?"))
        return q, f"The month after {m} is {n}.", f"The month after {m} is {n}.", n
    q = r.choice((f"How many days are in {m}?", f"How many days does {m} have?"))
    extra = " In a leap year it has 29." if m == "February" else ""
    return q, f"{m} has {days} days.", f"{m} has {days} days.{extra}", str(days)


def _week(r: random.Random):
    q = r.choice(("How many days are in a week?", "How many days does a week have?",
                  "Name the days of the week.", "What is the first day of the week?",
                  "How many months are in a year?", "How many days are in a year?"))
    if "Name" in q:
        return q, "There are seven days.", "The days are " + ", ".join(DAYS[:-1]) + \
            " and Sunday.", None
    if "first" in q:
        return q, "The week starts on Monday.", "The first day of the week is Monday.", "Monday"
    if "months" in q:
        return q, "A year has 12 months.", "A year has 12 months.", "12"
    if "year" in q:
        return q, "A year has 365 days.", "A year has 365 days, or 366 in a leap year.", "365"
    return q, "A week has 7 days.", "A week has 7 days.", "7"


# (from unit, to unit, factor, range of n, fact sentence)
_CONVERSIONS = (
    ("metres", "centimetres", 100, (1, 20), "One metre is 100 centimetres."),
    ("kilometres", "metres", 1000, (1, 20), "One kilometre is 1000 metres."),
    ("kilograms", "grams", 1000, (1, 20), "One kilogram is 1000 grams."),
    ("litres", "millilitres", 1000, (1, 20), "One litre is 1000 millilitres."),
    ("hours", "minutes", 60, (1, 10), "One hour is 60 minutes."),
    ("minutes", "seconds", 60, (1, 10), "One minute is 60 seconds."),
    ("days", "hours", 24, (1, 7), "One day is 24 hours."),
    ("weeks", "days", 7, (1, 10), "One week is 7 days."),
)


def _convert(r: random.Random):
    src, dst, f, (lo, hi), fact = r.choice(_CONVERSIONS)
    n = r.randint(lo, hi)
    q = r.choice((f"How many {dst} are in {n} {src}?", f"Convert {n} {src} to {dst}.",
                  f"What is {n} {src} in {dst}?"))
    if n == 1:
        q = q.replace(f"1 {src}", f"1 {src[:-1]}")
    v = n * f
    unit = src[:-1] if n == 1 else src
    return q, f"{fact} {n} x {f} = {v}.", f"{n} {unit} is {v} {dst}.", str(v)


# K3 Studio facts, answered correctly (README, DESIGN.md, SYSTEM.md): (phrasings, reasoning,
# answer text, the one right answer or None).
_FACTS = (
    (("What is the trunk?", "What does the trunk mean in K3 Studio?", "Explain the trunk."),
     "The user asks about the trunk.",
     "The trunk is the part of the model every token uses: attention, norms, the router and "
     "the shared expert. It can stream from disk layer by layer.", None),
    (("What is the expert cache?", "What does the expert cache do?", "Explain the expert cache."),
     "The user asks about the expert cache.",
     "The expert cache keeps recently used routed experts in memory, so a token reads from disk "
     "only the experts it is missing. The least recently used expert is evicted first.", None),
    (("What does the memory budget do?", "What is the memory budget?", "Explain the budget."),
     "The user asks about the memory budget.",
     "The budget splits memory between the trunk and the expert cache. It changes the speed "
     "only, never the tokens.", None),
    (("Does the budget change the output?", "Will a smaller budget change the answer?",
      "Do the tokens depend on the memory budget?"),
     "The engine is exact at every budget.",
     "No. The token ids are the same at every budget; only the speed changes.", "No"),
    (("How many routed experts does Kimi K3 have per layer?", "How many experts are in each layer "
      "of Kimi K3?", "How many experts does each K3 layer have?"),
     "Kimi K3 has 896 routed experts per layer.",
     "Kimi K3 has 896 routed experts per layer, and 16 of them fire for each token.", "896"),
    (("How many experts fire per token?", "How many experts does a token use?",
      "How many experts are active for one token?"),
     "In Kimi K3, 16 experts fire per token.",
     "16 routed experts fire for each token, in every layer, plus the shared expert.", "16"),
    (("How many layers does Kimi K3 have?", "How deep is Kimi K3?", "What is the number of layers "
      "in Kimi K3?"),
     "Kimi K3 has 93 layers.", "Kimi K3 has 93 layers.", "93"),
    (("How big is the Kimi K3 checkpoint?", "What is the size of the K3 checkpoint?",
      "How large is the Kimi K3 checkpoint?"),
     "The checkpoint is 1.56 TB.", "The Kimi K3 checkpoint is 1.56 TB.", "1.56"),
    (("Which preset should I use on a laptop?", "What preset fits a laptop?",
      "What is the laptop preset?"),
     "The laptop preset is for a laptop.",
     "Use the laptop preset: 3 GB of trunk and 1 GB of expert cache.", "laptop"),
    (("What is the smallest preset?", "Which preset needs the least memory?",
      "What preset uses the least memory?"),
     "The smallest preset is ultra.",
     "The smallest preset is ultra, about 3 GB planned. It is slow.", "ultra"),
    (("How do I pack the trunk?", "How can I pack the trunk?", "What command packs the trunk?"),
     "The user asks how to pack the trunk.",
     "Run k3 pack-trunk MODEL_DIR TRUNK_DIR once. It writes the trunk as one file.", "pack-trunk"),
    (("What are you?", "Are you Kimi K3?", "What model are you?"),
     "The user asks what I am.",
     "I am the K3 Studio demo model, a tiny model trained on a small corpus. I am not Kimi K3.",
     None),
    (("What is K3 Studio?", "What does K3 Studio do?", "Tell me about K3 Studio."),
     "The user asks about K3 Studio.",
     "K3 Studio runs the Kimi K3 model on one ordinary computer, exactly, and shows how it uses "
     "memory and disk.", None),
)


def _fact(r: random.Random):
    phr, reasoning, content, answer = r.choice(_FACTS)
    return r.choice(phr), reasoning, content, answer


# The mix favours the families that need a number copied from the question and a table
# looked up (arithmetic, conversions, months): the K3 Studio facts and greetings are few
# fixed strings the model learns from a handful of examples.
TASKS = (("greet", _greet, 1), ("thanks", _thanks, 1), ("add", _add, 5), ("sub", _sub, 4),
         ("mul", _mul, 4), ("day", _day_after, 2), ("dayplus", _day_plus, 2), ("month", _month, 3),
         ("week", _week, 1), ("convert", _convert, 6), ("fact", _fact, 2))


def _turn(r: random.Random, first: bool) -> Turn:
    names, fns, weights = zip(*TASKS)
    while True:
        i = r.choices(range(len(TASKS)), weights)[0]
        if names[i] == "thanks" and first:
            continue
        core, reasoning, content, answer = fns[i](r)
        if names[i] in ("greet", "thanks"):
            return Turn(core, reasoning, content, answer, names[i])
        user = r.choice(PREFIXES) + core + r.choice(SUFFIXES)
        return Turn(user, reasoning, content, answer, names[i])


# The app's first run on the demo offers a few prompts like these (k3studio's chat panel):
# one per family a person can check at a glance.  Seed 7 draws four the shipped demo answers
# right with the app's defaults (greedy, thinking at low effort; tests/test_demo_model.py
# checks it): several seeds' sets hold a sum it gets wrong ("1 plus 5 is 5."), a poor first
# impression of what a tiny model does learn.
EXAMPLE_FAMILIES = ("fact", "add", "day", "convert")
EXAMPLE_SEED = 7


def example_turns(seed: int = EXAMPLE_SEED, families=EXAMPLE_FAMILIES
                  ) -> list[tuple[str, str | None]]:
    """(prompt, the one right answer or None) for one prompt of each family as the training
    corpus words them, never a held-out one (off-corpus questions get confident nonsense)."""
    r = random.Random(seed)
    fns = {name: fn for name, fn, _ in TASKS}
    out = []
    for fam in families:
        q, _reasoning, _content, answer = fns[fam](r)
        while is_test_prompt(q):
            q, _reasoning, _content, answer = fns[fam](r)
        out.append((q, answer))
    return out


def example_prompts(seed: int = EXAMPLE_SEED) -> list[str]:
    return [q for q, _ in example_turns(seed)]


# ---- plain text -----------------------------------------------------------------------

def _drill(r: random.Random) -> str:
    """Shuffled one-answer facts in the replies' own wording: the lookup tables (sums,
    differences, products, conversions, months) at full loss weight without chat overhead."""
    fns = (_add, _sub, _mul, _convert, _month)
    return " ".join(r.choice(fns)(r)[2] for _ in range(r.randint(6, 12)))


def _plain(r: random.Random) -> str:
    kind = r.randrange(7)
    if kind >= 5:
        return _drill(r)
    if kind == 0:
        i = r.randrange(7)
        return "The days of the week are " + ", ".join(DAYS[(i + j) % 7] for j in range(7)) + "."
    if kind == 1:
        a = r.randint(0, 12)
        return " ".join(f"{a} plus {b} is {a + b}." for b in range(r.randint(0, 6), 13))
    if kind == 2:
        src, dst, f, (lo, hi), fact = r.choice(_CONVERSIONS)
        return fact + " " + " ".join(f"{n} {src} is {n * f} {dst}." for n in range(2, hi + 1))
    if kind == 3:
        return " ".join(r.choice(_FACTS)[2] for _ in range(3))
    return "The months are " + ", ".join(m for m, _ in MONTHS) + "."


# ---- the corpus -------------------------------------------------------------------------

def make_corpus(seed: int = 0, n_train: int = 9000, n_test: int = 400, n_plain: int = 1500) -> Corpus:
    """Conversations until both splits are full; one with any held-out prompt is test only
    (and test conversations are single-turn so each prompt is scored on its own)."""
    r = random.Random(seed)
    c = Corpus()
    seen_test: set[str] = set()
    while len(c.train) < n_train or len(c.test) < n_test:
        thinking = r.random() < 0.5
        system = r.choice(SYSTEMS) if r.random() < 0.4 else None
        turns = [_turn(r, True)]
        for _ in range(r.choices((0, 1, 2), (5, 3, 2))[0]):
            turns.append(_turn(r, False))
        held = [t for t in turns if is_test_prompt(t.user)]
        if held:
            t = held[0]
            if len(c.test) < n_test and t.user not in seen_test:
                seen_test.add(t.user)
                c.test.append(Conversation([t], system, thinking))
        elif len(c.train) < n_train:
            c.train.append(Conversation(turns, system, thinking))
    c.plain = [_plain(r) for _ in range(n_plain)]
    return c


def conversation_ids(tok, conv: Conversation) -> tuple[list[int], list[int]]:
    """(ids, mask): the rendered conversation and 1 where the model generates (every
    assistant reply from just after its generation prompt through its end id)."""
    from ..chat import ChatOptions, History, encode_prompt, render_segments
    opts = ChatOptions(thinking=conv.thinking)
    ids: list[int] = []
    mask: list[int] = []
    for n in range(1, len(conv.turns) + 1):
        h = conv.history(n)
        # the prompt of turn n is the rendering of turns < n plus user n and the gen prompt
        p = History(list(h)[:-1])
        prompt = encode_prompt(tok, render_segments(p, opts, generation_prompt=True))
        full = encode_prompt(tok, render_segments(h, opts, generation_prompt=False))
        assert full[:len(prompt)] == prompt, "render is not prefix-stable"
        assert full[:len(ids)] == ids, "turns do not extend each other"
        mask += [0] * (len(prompt) - len(ids)) + [1] * (len(full) - len(prompt))
        ids = full
    return ids, mask


_WORD = re.compile(r"[A-Za-z]+")


def words(text: str) -> list[str]:
    """The words of a text, as the note counts them (letters only, case folded)."""
    return [w.lower() for w in _WORD.findall(text)]


def corpus_words(c: Corpus) -> set[str]:
    out: set[str] = set()
    for conv in c.train:
        for t in conv.turns:
            out.update(words(t.user + " " + t.reasoning + " " + t.content))
        if conv.system:
            out.update(words(conv.system))
    for p in c.plain:
        out.update(words(p))
    return out
