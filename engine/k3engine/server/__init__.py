"""`k3 serve`: the engine behind OpenAI-compatible and Anthropic Messages HTTP APIs.

    protocol.py   the OpenAI wire format: request validation, refusals, error shape, bodies
                  and stream chunks; what both protocols share (GenRequest, Limits, names)
    messages.py   the Anthropic Messages wire format (/v1/messages), onto the same GenRequest
    stops.py      stop strings over a stream of text deltas (hold back, trim); control text
    engine.py     the one engine thread, its bounded queue and the adapter to the engine
    app.py        the FastAPI routes: auth, body limits, SSE streaming, keep-alives,
                  disconnect = cancel, access log
    transport.py  the header deadline uvicorn lacks
    main.py       `k3 serve` argv, the bind/key rules, uvicorn and its limits

The server is one more front end of the engine (docs/architecture.md): it builds its
LoadSpec with the same `load_spec_from` as `k3`, and streams the events of a
Conversation's turns (chat) or of the decode generator (completions).
"""
