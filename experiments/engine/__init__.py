"""The engine loop: scheduling and batching, prefill chunk size, what hardening costs."""
