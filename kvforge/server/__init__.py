"""llm_serve: an OpenAI-compatible HTTP server on the engine loop (a front end, layer 3)."""
