"""`k3 serve`: the engine behind an OpenAI-compatible HTTP API on loopback.

    protocol.py   the OpenAI wire format: request validation, error shape, response bodies
    stops.py      stop strings over a stream of text deltas (hold back, trim)
    engine.py     the one engine thread, its bounded queue and the adapter to the run API
    app.py        the FastAPI routes: auth, body limits, SSE streaming, disconnect = cancel
    main.py       `k3 serve` argv, the bind/key rules, uvicorn

The server is one more front end of the run API (DESIGN.md): it builds a RunRequest with
the same `request_from` as `k3`, and streams the events of `Run.turn`.
"""
