"""Pagoda on Ray Serve.

    gRPC :9000 ─┐
    HTTP :8000 ─┴─> Serve proxies ─> Ingress (ingress.py: gRPC methods + OpenAI routes, validation)
                                       │ deployment handle, streaming
                                       ▼
                                     LLMServer (llm_server.py: the engine loop in a thread)
                                       (engine_in_ingress: in the Ingress's process, in_process.py)

Plain classes; `serve.deployment` is applied only in app.build_app.
"""
