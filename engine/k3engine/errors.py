"""Exit codes (SYSTEM §6.5) and how each engine failure is reported: one mapping for the
CLI, the REPL, the app and the server, so a person sees the same message and code in all.

A leaf module: the engine's error classes derive from `EngineError` and carry their exit
code and message prefix, so `describe` needs to import nothing of the engine.
"""
from __future__ import annotations

EXIT_OK, EXIT_RUNTIME, EXIT_USAGE, EXIT_OUT, EXIT_DROP, EXIT_INTERRUPTED = 0, 1, 2, 3, 4, 5

EXIT_MEANING = {EXIT_OK: "success", EXIT_RUNTIME: "runtime failure",
                EXIT_USAGE: "usage or configuration", EXIT_OUT: "results not written",
                EXIT_DROP: "routed expert failed to load", EXIT_INTERRUPTED: "interrupted"}


class EngineError(Exception):
    """A failure the engine reports to a person (as opposed to a bug, which propagates)."""
    exit_code = EXIT_RUNTIME
    prefix = "k3"

    def report(self) -> str:
        """The message exactly as `k3` prints it."""
        return f"{self.prefix}: {self}"


class UsageError(EngineError):
    """Bad or conflicting options, limits (exit 2); an empty message prints the usage."""
    exit_code = EXIT_USAGE


class LimitError(UsageError):
    """A request beyond what the engine holds (exit 2), refused before any work: `kind` is
    'prompt' (too many prompt ids), 'positions' (the position ceiling), 'kv_cache' (its KV
    cache does not fit the memory available), 'vocab' (an id outside the vocabulary).
    The server answers 400 naming it; the CLI exits 2; the app says why."""

    def __init__(self, message: str, kind: str):
        super().__init__(message)
        self.kind = kind


class PlanRefused(EngineError):
    """The memory plan refused the run; its refusals were reported with the plan."""

    def __init__(self, plan):
        super().__init__("\n".join(f"k3: {r.message}" for r in plan.refusals))
        self.plan = plan
        self.exit_code = plan.exit_code

    def report(self) -> str:
        return str(self)


class StateUnusable(EngineError):
    """A sequence state that a failed or stopped forward pass left half advanced
    (SYSTEM §4.9): it may not be saved, resumed or reused."""


def describe(e: BaseException) -> tuple[int, str, str] | None:
    """(exit code, error kind, message) for an engine failure, exactly as `k3` prints it;
    None for an exception that is not an engine failure (a bug: let it propagate)."""
    if isinstance(e, EngineError):
        return e.exit_code, type(e).__name__, e.report()
    return None
