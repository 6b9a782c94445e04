"""The chat sampler (SYSTEM §9.5): PCG32 (XSH-RR) plus temperature / top-p / top-k selection.

Everything here is exact against the reference: the PRNG stream, the order of the two draws
inside `unit()`, float64 probabilities summed strictly in index order (keep/acc in sorted
order), ties broken by the lowest id, and libm `exp` (``math.exp``; NumPy's vectorised
``exp`` is not guaranteed to round like libm, and one ulp moves a top-p boundary).  With
``--seed`` a transcript therefore replays token for token against the C engine.

Turn index: the stream is reseeded for every assistant turn with ``new_turn(turn)``, where
``turn = turn0 + k + 1``; ``turn0`` is the number of assistant messages in the history when
the chat loop starts and ``k`` counts the turns this session has completed (not reset by
``/reset``).
"""
from __future__ import annotations

import math
import time

import numpy as np
from .errors import EXIT_USAGE, EngineError

__all__ = ["SamplerError", "Pcg32", "splitmix64", "select", "Sampler", "clock_seed",
           "DEFAULT_TEMPERATURE", "DEFAULT_TOP_P"]

MASK64 = (1 << 64) - 1
MASK32 = (1 << 32) - 1
GOLDEN = 0x9E3779B97F4A7C15
PCG_MULT = 6364136223846793005
TWO_POW_53 = 9007199254740992.0

DEFAULT_TEMPERATURE = 1.0
DEFAULT_TOP_P = 0.95


class SamplerError(EngineError, ValueError):
    exit_code = EXIT_USAGE

    """Invalid sampler settings or logits; the chat prints `chat: sampler failed`."""


def splitmix64(x: int) -> tuple[int, int]:
    """One splitmix64 step: returns (updated x, output). The C version updates x in place."""
    x = (x + GOLDEN) & MASK64
    z = x
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return x, z ^ (z >> 31)


class Pcg32:
    """PCG32 XSH-RR seeded from (seed, turn) exactly as the reference's k3_sampler_init."""

    __slots__ = ("state", "inc")

    def __init__(self, seed: int, turn: int):
        x = (int(seed) ^ (int(turn) * GOLDEN)) & MASK64
        x, st = splitmix64(x)
        x, sq = splitmix64(x)
        self.inc = ((sq << 1) | 1) & MASK64
        self.state = 0
        self.next32()
        self.state = (self.state + st) & MASK64
        self.next32()

    def next32(self) -> int:
        old = self.state
        self.state = (old * PCG_MULT + self.inc) & MASK64
        xs = (((old >> 18) ^ old) >> 27) & MASK32
        rot = old >> 59
        return ((xs >> rot) | (xs << (-rot & 31))) & MASK32

    def unit(self) -> float:
        """A float64 in [0, 1) from 53 bits. `a` is drawn first: the C expression leaves the
        order unspecified and GCC x86-64 evaluates the left draw first; the other order gives
        a different stream (§9.5 check values)."""
        a = self.next32()
        b = self.next32()
        return ((a << 21) ^ (b & 0x1FFFFF)) / TWO_POW_53


def _check_settings(temperature: float, top_p: float, top_k: int, min_p: float = 0.0) -> None:
    # `not x > 0` rather than `x <= 0`, so NaN is refused as well.
    if not temperature > 0.0:
        raise SamplerError(f"temperature must be > 0, got {temperature!r}")
    if not (top_p > 0.0 and top_p <= 1.0):
        raise SamplerError(f"top-p must be in (0, 1], got {top_p!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or top_k < 0:
        raise SamplerError(f"top-k must be an integer >= 0 (0 = off), got {top_k!r}")
    if not 0.0 <= min_p < 1.0:
        raise SamplerError(f"min-p must be in [0, 1) (0 = off), got {min_p!r}")


def _is_u64(v: object) -> bool:
    return (isinstance(v, (int, np.integer)) and not isinstance(v, bool)
            and 0 <= v <= MASK64)


def _argmax_first(a: np.ndarray) -> int:
    """The reference's `if (logits[i] > logits[best]) best = i` loop: the first maximum wins,
    and NaN never compares greater (so a NaN at index 0 stays the answer, as in C).
    np.argmax alone would pick a NaN anywhere."""
    best = int(np.argmax(a))  # first maximum, or the first NaN if there is any
    if not math.isnan(a[best]):
        return best
    if math.isnan(a[0]):
        return 0
    return int(np.nanargmax(a))


def _first_true(mask: np.ndarray) -> int:
    """Index of the first True, or -1."""
    i = int(np.argmax(mask))
    return i if mask[i] else -1


def select(logits: np.ndarray, temperature: float, top_p: float, top_k: int,
           rng: Pcg32 | None, greedy: bool, min_p: float = 0.0) -> int:
    """Pick one id from float32 `logits` (§9.5). Greedy and degenerate cases draw nothing.
    `min_p` (ours, not the reference's; 0 = off, the reference's stream) also drops every
    id whose probability is below min_p times the most likely one's; the survivors are a
    prefix of the sorted order, so it only narrows the top-k window."""
    a = np.asarray(logits)
    if a.dtype != np.float32 or a.ndim != 1:
        raise SamplerError(f"logits must be a 1-D float32 array, got {a.dtype} {a.shape}")
    n = a.shape[0]
    if n <= 0:
        raise SamplerError("no logits (vocabulary of size 0)")
    temperature, top_p = float(temperature), float(top_p)
    # Checked even in greedy mode, as the reference does.
    _check_settings(temperature, top_p, top_k, min_p)
    best = _argmax_first(a)
    if greedy:
        return best
    if rng is None:
        raise SamplerError("sampling needs a PRNG stream: call new_turn(turn) first")

    m = float(a[best]) / temperature
    # Elementwise IEEE ops, same rounding as C. inf - inf (an infinite logit) gives NaN,
    # which the finiteness check below turns into the greedy fallback, as in C.
    with np.errstate(invalid="ignore", over="ignore"):
        x = a.astype(np.float64) / temperature - m
    try:
        p = np.fromiter(map(math.exp, x.tolist()), dtype=np.float64, count=n)
    except OverflowError:
        # C's exp returns inf here, which makes the sum non-finite: the greedy fallback.
        return best
    # ufunc.accumulate adds strictly left to right (np.sum is pairwise and Python's sum()
    # is compensated since 3.12: either would round differently from the C loop).
    s = float(np.add.accumulate(p)[-1])
    if not math.isfinite(s) or not s > 0.0:
        return best
    p /= s
    # Stable sort of -p: descending probability, equal probabilities by ascending id.
    order = np.argsort(-p, kind="stable")
    w = min(int(top_k), n) if top_k > 0 else n
    if min_p > 0.0:
        w = min(w, int(np.count_nonzero(p >= min_p * p[order[0]])))
    cum = np.add.accumulate(p[order[:w]])  # keep / acc, summed in sorted order
    # `while k < w and keep < top_p: keep += p[order[k]]; k += 1`: stops after the first
    # prefix sum that is >= top_p (no NaN can occur past the finiteness check).
    j = _first_true(cum >= top_p)
    k = max(j + 1 if j >= 0 else w, 1)
    keep = float(cum[k - 1])
    r = rng.unit() * keep
    # `acc += p[order[i]]; if r < acc or i == k-1: return order[i]` over the same sums.
    i = _first_true(r < cum[:k])
    return int(order[i if i >= 0 else k - 1])


def clock_seed() -> int:
    """A fresh 64-bit seed for a session without --seed (printed in the banner so the session
    can be replayed). splitmix64 spreads the nanosecond clock over all 64 bits."""
    return splitmix64(time.time_ns() & MASK64)[1]


class Sampler:
    """One chat session's sampler. Greedy (argmax) unless sampling was asked for."""

    def __init__(self, temperature: float = DEFAULT_TEMPERATURE, top_p: float = DEFAULT_TOP_P,
                 top_k: int = 0, seed: int = 0, greedy: bool = True, min_p: float = 0.0):
        _check_settings(float(temperature), float(top_p), top_k, float(min_p))
        if not _is_u64(seed):
            raise SamplerError(f"seed must be an unsigned 64-bit integer, got {seed!r}")
        self.temperature = float(temperature)
        self.top_p = float(top_p)
        self.top_k = int(top_k)
        self.min_p = float(min_p)
        self.seed = int(seed)
        self.greedy = bool(greedy)
        self.turn: int | None = None
        self._rng: Pcg32 | None = None

    @classmethod
    def from_flags(cls, temperature: float | None = None, top_p: float | None = None,
                   top_k: int | None = None, seed: int | None = None, greedy: bool = False,
                   min_p: float | None = None, *, clock=clock_seed) -> "Sampler":
        """The CLI rule: any of temperature/top-p/top-k/seed switches sampling on, --greedy
        forces argmax anyway; unset values take the §9.5 defaults, the seed comes from the
        clock when not given."""
        asked = any(v is not None for v in (temperature, top_p, top_k, seed, min_p))
        return cls(DEFAULT_TEMPERATURE if temperature is None else temperature,
                   DEFAULT_TOP_P if top_p is None else top_p,
                   0 if top_k is None else top_k,
                   clock() if seed is None else seed,
                   greedy=greedy or not asked, min_p=0.0 if min_p is None else min_p)

    @property
    def sampling(self) -> bool:
        return not self.greedy

    def new_turn(self, turn: int) -> None:
        """Reseed the stream for one assistant turn (`turn = turn0 + k + 1`, module doc)."""
        if not _is_u64(turn):
            raise SamplerError(f"turn must be an unsigned 64-bit integer, got {turn!r}")
        self.turn = int(turn)
        self._rng = Pcg32(self.seed, self.turn)

    def skip(self, n: int) -> None:
        """Advance the stream as `n` sampled ids would have (one draw each; a step that fell
        back to greedy drew none): a reply resumed without its state (Conversation)."""
        if self.sampling and self._rng is not None:
            for _ in range(n):
                self._rng.unit()

    def sample(self, logits: np.ndarray) -> int:
        """Next id. Greedy never touches the stream, so it needs no turn."""
        return select(logits, self.temperature, self.top_p, self.top_k, self._rng, self.greedy,
                      self.min_p)

    def mode_text(self) -> str:
        """The chat banner's sampling word (§9.4)."""
        return "temperature/top-p sampling" if self.sampling else "greedy"

    def banner_line(self) -> str | None:
        """`  sampler  : PCG32 seed S, temperature T, top-p P[, top-k K]`, only when sampling;
        the top-k part appears only when --top-k was given (top_k > 0)."""
        if not self.sampling:
            return None
        line = (f"  sampler  : PCG32 seed {self.seed}, temperature {self.temperature:.3f}, "
                f"top-p {self.top_p:.3f}")
        return line + (f", top-k {self.top_k}" if self.top_k > 0 else "") + \
            (f", min-p {self.min_p:.3f}" if self.min_p > 0 else "")

    def __repr__(self) -> str:
        return (f"Sampler(temperature={self.temperature}, top_p={self.top_p}, top_k={self.top_k}, "
                f"seed={self.seed}, greedy={self.greedy}, min_p={self.min_p}, turn={self.turn})")
