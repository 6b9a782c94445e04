"""`k3 serve`: the engine behind an OpenAI-compatible HTTP API on loopback.

    protocol.py   the OpenAI wire format: request validation, error shape, response bodies
    stops.py      stop strings over a stream of text deltas (hold back, trim)
    engine.py     the one engine thread, its bounded queue and the adapter to the engine
    app.py        the FastAPI routes: auth, body limits, SSE streaming, disconnect = cancel
    main.py       `k3 serve` argv, the bind/key rules, uvicorn

The server is one more front end of the engine (docs/architecture.md): it builds its
LoadSpec with the same `load_spec_from` as `k3`, and streams the events of a
Conversation's turns (chat) or of the decode generator (completions).
"""
