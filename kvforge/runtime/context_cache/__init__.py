"""Content-addressed KV-cache reuse: the coordinator (`manager`), its records, keys, planner and eviction here, and one
module per resource type in `types/` (base KV pages, recurrent snapshots, partial-KV snapshots, draft KV pages,
documents, sliding-window pages, adapter corrections), registered in lookup order by `registry`."""
