"""``kvboost-rag serve``: an OpenAI-compatible HTTP server with continuous batching and per-tenant KV reuse.

Modules: ``protocol`` (wire format), ``scheduler`` (the batching loop on the engine thread), ``app`` (routes),
``auth`` (API keys → namespaces), ``metrics`` (Prometheus), ``state`` (what routes share), ``main`` (the
command), ``catalogue`` (warmed documents shared through Redis), ``ray_serve``
(``--ray``: replicas on Ray Serve). Importing this package is cheap; FastAPI, uvicorn and Ray load when the
server is built.
"""
