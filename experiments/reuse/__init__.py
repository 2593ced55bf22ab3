"""Context reuse: the context cache, partial-KV snapshots, recurrent checkpoints, documents, the shared tier."""
