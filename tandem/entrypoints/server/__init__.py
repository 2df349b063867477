"""tandem's HTTP server: OpenAI- and Ollama-compatible APIs over one AsyncEngine.

One process: uvicorn's event loop serves HTTP while the engine steps in its own
thread. The server never schedules: it validates, tokenizes, admits (bounded
queue), streams the engine's deltas, and turns the engine's phase timings into
response fields, Prometheus metrics and log lines.
"""
