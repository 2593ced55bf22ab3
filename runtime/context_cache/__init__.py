"""Content-addressed KV-cache reuse: page keys, the page pool, page index, records, planner, manager."""
