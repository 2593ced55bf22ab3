"""Paged-KV custom ops: schemas, numpy reference semantics and backend lowerings."""
