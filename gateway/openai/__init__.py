"""The OpenAI-compatible HTTP API of the gateway, laid out as vLLM's ``vllm/entrypoints/openai/``.

``protocol``: the request bodies, usage and the error body; ``serving_engine``: what both endpoints
share; ``serving_completion`` / ``serving_chat``: one class per endpoint; ``bridge``: the gateway's
blocking streams run on threads, bridged to asyncio, and SSE framing; ``api_server``: ``create_app``
and ``HttpServer`` (uvicorn in a thread).
"""
