"""Exit codes (SYSTEM §6.5) and how each engine failure is reported: one mapping for the
CLI and the app, so a person sees the same message and code in both."""
from __future__ import annotations

EXIT_OK, EXIT_RUNTIME, EXIT_USAGE, EXIT_OUT, EXIT_DROP, EXIT_INTERRUPTED = 0, 1, 2, 3, 4, 5


def describe(e: BaseException) -> tuple[int, str, str] | None:
    """(exit code, error kind, message) for an engine failure, exactly as `k3` prints it;
    None for an exception that is not an engine failure (a bug: let it propagate)."""
    from .chat import ChatError
    from .checkpoint import CheckpointError
    from .config import ConfigError
    from .experts import ExpertCacheError, ExpertLoadError
    from .memory import BudgetError
    from .sampler import SamplerError
    from .statefile import StateFileError
    from .tokenizer import TokenizerError
    kind = type(e).__name__
    if isinstance(e, ConfigError):
        return EXIT_USAGE, kind, (f"k3: {e}\nABORTED: the model config could not be read "
                                  f"with confidence.")
    if isinstance(e, BudgetError):
        return e.exit_code, kind, f"k3: {e}"
    if isinstance(e, ExpertLoadError):
        return EXIT_DROP, kind, f"RUN INVALID: {e}; the affected token was not emitted"
    if isinstance(e, (CheckpointError, StateFileError, TokenizerError, ExpertCacheError)):
        return EXIT_RUNTIME, kind, f"k3: {e}"
    if isinstance(e, ChatError):
        return EXIT_RUNTIME, kind, f"chat: {e}"
    if isinstance(e, SamplerError):
        return EXIT_USAGE, kind, f"k3: {e}"
    return None
