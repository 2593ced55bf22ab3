"""Content-addressed KV-cache reuse: page keys, resource pools, block index, records, planner, manager."""
