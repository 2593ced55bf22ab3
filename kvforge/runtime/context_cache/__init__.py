"""Content-addressed KV-cache reuse: a coordinator over one class per resource type (base KV pages, recurrent
snapshots, partial-KV snapshots, draft KV pages), each with its pool and its part of leases and records."""
