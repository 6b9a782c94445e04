"""`k3 serve MODEL_DIR [...]`: load the model once, then serve it over HTTP.

Binding rules: loopback (127.0.0.1, ::1, localhost) by default; any other address needs an
API key (--api-key, or K3_API_KEY so it stays out of `ps`) or an explicit
--insecure-no-key.  The key is never printed.  `--port 0` picks a free port; the line
`k3 serve: listening on http://HOST:PORT` says which (tests and scripts read it).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import sys

from ..errors import EXIT_OK, EXIT_USAGE, describe
from ..experts import POLICIES
from ..engine import MAX_GEN, MAX_PROMPT
from ..memory import AUTO_SEQUENCES, most_sequences
from .loopback import is_loopback

USAGE_NOTE = """\
endpoints: GET /health, GET /v1/models, POST /v1/chat/completions, POST /v1/completions
(OpenAI-compatible), POST /v1/messages (Anthropic Messages); streamed as server-sent events
with "stream": true.  GET /k3/steps?since=N (loopback only): the engine's recent steps.
Up to --parallel requests decode together (continuous batching: one trunk pass a step for
all of them); up to --queue more wait, beyond that 429 with Retry-After.  Timeouts and
limits: docs/serving.md.
exit codes: 0 stopped cleanly, 1 the model could not be loaded, 2 bad options or plan."""


class _Memory(argparse.Action):
    """Memory flags keep their argv order: `k3` applies them in order (resolve_budgets)."""

    def __call__(self, parser, ns, value, option_string=None):
        ns.memory.append((option_string, True if self.nargs == 0 else value))



def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="k3 serve", epilog=USAGE_NOTE,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                description="Serve a K3 checkpoint over an OpenAI-compatible "
                                            "HTTP API.")
    p.add_argument("model_dir")
    p.add_argument("--trunk", help="packed trunk (k3 pack-trunk): stream the trunk from it")
    p.add_argument("--tok", help="tokenizer directory (default: MODEL_DIR when it holds "
                                 "tiktoken.model)")
    p.add_argument("--config", help="config file (default MODEL_DIR/config.json)")
    for flag in ("--preset", "--trunk-gb", "--cache-gb"):
        p.add_argument(flag, action=_Memory, dest="memory_" + flag[2:].replace("-", "_"),
                       metavar="X")
    p.add_argument("--ultra-low-memory", action=_Memory, nargs=0, dest="memory_ultra")
    p.add_argument("--trunk-ring", type=int, default=2, choices=range(1, 9), metavar="N")
    p.add_argument("--cache-policy", choices=sorted(POLICIES),
                   help="expert replacement (default lru, the reference's; or K3_CACHE_POLICY)")
    p.add_argument("--threads", type=int, default=0, metavar="N")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0: any free port")
    p.add_argument("--api-key", help="require Authorization: Bearer KEY or x-api-key: KEY "
                                     "(or set K3_API_KEY)")
    p.add_argument("--insecure-no-key", action="store_true",
                   help="allow a non-loopback --host without a key")
    p.add_argument("--queue", type=int, default=4, metavar="N",
                   help="requests that may wait for the engine (default 4)")
    p.add_argument("--gen", type=int, default=MAX_GEN, metavar="N",
                   help=f"max_tokens ceiling and default (1..{MAX_GEN})")
    p.add_argument("--parallel", type=int, default=None, metavar="N",
                   help="requests decoded together (continuous batching): each step reads "
                        "the trunk once for all of them; the plan counts N sequences of "
                        f"--gen positions (default: as many as the plan allows, up to "
                        f"{AUTO_SEQUENCES})")
    p.add_argument("--spec", type=int, default=0, metavar="N",
                   help="n-gram speculative decoding of greedy requests, up to N (<= 8) "
                        "drafts per sweep: same ids as plain greedy, fewer trunk passes")
    p.add_argument("--draft-model", metavar="DIR",
                   help="a block drafter folder (docs/drafter.md) proposes the drafts of "
                        "greedy requests; width --spec N (default: its block size - 1, at "
                        "most 8); same ids as plain greedy")
    p.add_argument("--prompt-cache-gb", type=float, default=0.0, metavar="X",
                   help="memory for the sequences kept for later requests (default 0: one, "
                        "as the plan counts); a request continues the one holding most of "
                        "its prompt")
    p.add_argument("--prompt-cache-dir", metavar="DIR",
                   help="also keep them on disk (state files, 0600), so a restarted server "
                        "skips the prefill of a conversation it has seen")
    p.add_argument("--prompt-cache-disk-gb", type=float, default=8.0, metavar="X",
                   help="the folder's cap; the oldest files go first (default 8)")
    p.add_argument("--model-id", help="the id /v1/models lists (default: MODEL_DIR's name)")
    p.add_argument("--max-body-bytes", type=int, default=8 << 20, metavar="N")
    p.add_argument("--max-messages", type=int, default=1024, metavar="N")
    p.add_argument("--max-prompt", type=int, default=MAX_PROMPT, metavar="N",
                   help=f"prompt ids per request (1..{MAX_PROMPT})")
    p.add_argument("--alias", action="append", default=[], metavar="NAME",
                   help="another model name requests may give (repeatable)")
    p.add_argument("--accept-any-model", action="store_true",
                   help="accept any model name (responses echo it)")
    p.add_argument("--timeout-header", type=float, default=10.0, metavar="S",
                   help="a connection's request line and headers must arrive within S "
                        "seconds (default 10)")
    p.add_argument("--timeout-body", type=float, default=30.0, metavar="S",
                   help="a request's body must arrive within S seconds (default 30)")
    p.add_argument("--timeout-keep-alive", type=float, default=5.0, metavar="S",
                   help="close a kept-alive connection idle for S seconds (default 5)")
    p.add_argument("--sse-keepalive", type=float, default=5.0, metavar="S",
                   help="a waiting stream gets a `: keep-alive` comment every S seconds "
                        "(default 5)")
    p.add_argument("--max-connections", type=int, default=512, metavar="N",
                   help="open connections; a request beyond them gets 503 (default 512, "
                        "under the usual 1024 open-file limit)")
    p.add_argument("--access-log", action="store_true",
                   help="log each request: client, method, path, status, seconds (never "
                        "keys, query strings or content)")
    p.set_defaults(memory=[])
    return p


def check_options(a) -> str | None:
    """The refusal for these options, or None."""
    if not is_loopback(a.host) and not a.api_key and not a.insecure_no_key:
        return (f"--host {a.host} is not a loopback address: give --api-key KEY (or set "
                f"K3_API_KEY), or --insecure-no-key to serve it without one")
    if a.queue < 0:
        return "--queue must be >= 0"
    if not 0 <= a.spec <= 8:
        return "--spec must be in 0..8"
    if a.parallel is not None and not 1 <= a.parallel <= 64:
        return "--parallel must be in 1..64"
    for flag, v in (("--prompt-cache-gb", a.prompt_cache_gb),
                    ("--prompt-cache-disk-gb", a.prompt_cache_disk_gb)):
        if not (v >= 0 and v < 1e6):         # NaN and inf fail both
            return f"{flag} must be a number of GB >= 0"
    if not 1 <= a.gen <= MAX_GEN:
        return f"--gen must be in 1..{MAX_GEN}"
    if not 1 <= a.max_prompt <= MAX_PROMPT:
        return f"--max-prompt must be in 1..{MAX_PROMPT}"
    if not 0 <= a.port <= 65535:
        return "--port must be in 0..65535"
    if a.api_key is not None and not a.api_key.strip():
        return "--api-key must not be empty"
    for flag in ("timeout_header", "timeout_body", "timeout_keep_alive", "sse_keepalive"):
        if not 0 < getattr(a, flag) <= 86400:
            return f"--{flag.replace('_', '-')} must be in (0, 86400] seconds"
    if a.max_connections < 1:
        return "--max-connections must be >= 1"
    if any(not n.strip() for n in a.alias):
        return "--alias must not be empty"
    return None


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host.strip("[]"), port))
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def main(argv: list[str]) -> int:
    a = parser().parse_args(argv)
    a.api_key = a.api_key or os.environ.get("K3_API_KEY") or None
    why = check_options(a)
    if why:
        print(f"k3 serve: {why}", file=sys.stderr)
        return EXIT_USAGE
    if a.tok is None and os.path.exists(os.path.join(a.model_dir, "tiktoken.model")):
        a.tok = a.model_dir
    try:
        sock = bind(a.host, a.port)
    except OSError as e:
        print(f"k3 serve: cannot listen on {a.host}:{a.port}: {e.strerror or e}",
              file=sys.stderr)
        return EXIT_USAGE
    from ..engine import load_spec_from, open_engine
    from ..console import Printer
    from ..telemetry import Events
    from .app import create_app
    from .engine import Backend, EngineThread
    from .protocol import Limits, ModelNames
    try:
        if a.draft_model and not a.spec:                 # the drafter's own block
            from ..drafter import default_width
            a.spec = default_width(a.draft_model)

        def opened(n: int, sink, plan_only: bool = False):
            spec = load_spec_from(a.model_dir, a.memory, trunk_dir=a.trunk, tok_dir=a.tok,
                                  config_path=a.config, trunk_ring=a.trunk_ring,
                                  threads=a.threads, incremental=True, spec=a.spec,
                                  cache_policy=a.cache_policy, sequences=n,
                                  drafter_dir=a.draft_model)
            # the plan's KV cache: n sequences of up to --gen + 1 positions each
            return open_engine(spec, sink, gen=n * (a.gen + 1) - 1, plan_only=plan_only)
        if a.parallel is None:
            a.parallel = plan_parallel(lambda n: opened(n, None, True))
            print(f"k3 serve: {a.parallel} parallel slot(s), as many as the plan allows "
                  f"(up to {AUTO_SEQUENCES}; --parallel N sets it)", flush=True)
        eng = opened(a.parallel, Printer(Events()))
    except Exception as e:
        d = describe(e)
        if d is None:
            raise
        print(d[2], file=sys.stderr)
        sock.close()
        return d[0]
    model_id = a.model_id or os.path.basename(os.path.normpath(a.model_dir))
    limits = Limits(max_body_bytes=a.max_body_bytes, max_messages=a.max_messages,
                    max_prompt_ids=a.max_prompt, max_tokens=a.gen)
    from ..prompt_cache import PromptCache
    try:
        cache = PromptCache(eng, int(a.prompt_cache_gb * 1e9), a.prompt_cache_dir,
                            int(a.prompt_cache_disk_gb * 1e9))
    except OSError as e:
        print(f"k3 serve: cannot use --prompt-cache-dir {a.prompt_cache_dir}: "
              f"{e.strerror or e}", file=sys.stderr)
        eng.close()
        sock.close()
        return EXIT_USAGE
    backend = Backend(eng, model_id, limits, a.spec, cache)
    if a.parallel > 1:
        from .batching import BatchingEngineThread
        engine = BatchingEngineThread(backend, a.queue, a.parallel)
    else:
        engine = EngineThread(backend, a.queue)
    app = create_app(engine, ModelNames(model_id, tuple(a.alias), a.accept_any_model),
                     a.api_key, limits, **tokenizer_facts(eng.tok),
                     keepalive_s=a.sse_keepalive, body_timeout_s=a.timeout_body,
                     access_log=access_logger() if a.access_log else None)
    code = serve_until_stopped(app, sock, a)
    engine.close()                         # cancels a running generation at a safe point
    backend.close()
    return code


def plan_parallel(plan_n) -> int:
    """The most slots the memory plan admits, up to AUTO_SEQUENCES (`plan_n(n)` plans
    without loading, or raises PlanRefused)."""
    from ..errors import PlanRefused

    def admitted(n: int) -> bool:
        try:
            plan_n(n)
            return True
        except PlanRefused:
            return False
    return most_sequences(admitted)


def tokenizer_facts(tok) -> dict:
    """What the routes need from the tokenizer: the added tokens' text (never sent as
    completion text) and the chat's end ids (an Anthropic end_turn)."""
    if tok is None:
        return {}
    from ..chat import ChatSetupError
    from ..engine import chat_controls
    try:
        ends = frozenset(chat_controls(tok).end_ids)
    except ChatSetupError:                 # no chat controls: the chat routes refuse
        ends = frozenset()
    return {"hidden_text": tuple(tok.added.values()), "end_ids": ends}


def access_logger():
    def log(line: str) -> None:
        print(f"k3 serve: {line}", file=sys.stderr, flush=True)
    return log


def uvicorn_config(app, a):
    """uvicorn with our bounds: header deadline (transport.py), header size, idle
    keep-alive, connection count.  Its own access log stays off: it logs query strings
    and logs nothing at our log level; AccessLog (app.py) replaces it."""
    import uvicorn
    from .transport import MAX_HEADER_BYTES, bounded_protocol
    return uvicorn.Config(app, log_level="warning", access_log=False,
                          http=bounded_protocol(a.timeout_header),
                          h11_max_incomplete_event_size=MAX_HEADER_BYTES,
                          timeout_keep_alive=a.timeout_keep_alive,
                          limit_concurrency=a.max_connections,
                          timeout_graceful_shutdown=5)


def serve_until_stopped(app, sock: socket.socket, a) -> int:
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            """Ours are installed before the `listening` line (below).  uvicorn's own
            version installs them only once it runs, so a SIGTERM right after that line
            killed the process, and it re-raises the signal once the server is down, which
            ends the process before the engine is closed at a safe point."""
            yield

    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    server = Server(uvicorn_config(app, a))
    # SIGINT/SIGTERM ask the server to stop; a second SIGINT forces it (uvicorn's handler)
    old = {s: signal.signal(s, server.handle_exit) for s in (signal.SIGINT, signal.SIGTERM)}
    key = "key required" if a.api_key else "no key"
    try:
        print(f"k3 serve: listening on http://{shown}:{port} (model id "
              f"{a.model_id or os.path.basename(os.path.normpath(a.model_dir))}, {key}, "
              f"queue {a.queue})", flush=True)
        server.run(sockets=[sock])
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    print("k3 serve: stopped", flush=True)
    return EXIT_OK
