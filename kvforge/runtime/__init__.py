"""The engine, by concern: engine/ (loop), inputs/, execution/, sampling/, spec/, context_cache/, shared_tier/.

The modules at this level are the vocabulary every folder speaks (types, sequence, step, adapters, media spans,
profile) and the front ends written on the engine (`api`, `cli`, `file_loop`)."""
