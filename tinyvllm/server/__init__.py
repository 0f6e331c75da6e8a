"""`tinyvllm serve`: an OpenAI-compatible HTTP server on the LLMEngine (FastAPI + uvicorn + pydantic).

    protocol.py     the request bodies (OpenAI's fields plus vLLM's sampling extras) and the error body
    sampling.py     a request's fields as SamplingParams; a field the engine does not have yet is refused
    prompts.py      prompts to token ids, with the length checks done before the engine sees them
    engine_core.py  the loop that owns the engine and steps it: in a process of its own, or in a thread
    engine_loop.py  the front end: handlers submit requests and read their outputs, token ids become text
    request_state.py  one request's token ids as text and outputs, stop strings looked for
    serving.py      the two generation endpoints: one JSON response, or server-sent events
    logprobs.py     log-probabilities in OpenAI's response shapes
    middleware.py   API key and request-size limit, before any body is parsed
    metrics.py      Prometheus text for /metrics
    app.py          the FastAPI application: routes and error handlers
    options.py      `tinyvllm serve`'s command-line options
    launch.py       uvicorn, with a graceful stop on SIGTERM

Nothing here is imported by the engine; this package needs the `serve` extra (pip install -e '.[serve]').
"""
