"""A KV tier shared by every process serving the same engine: stores (store.py), values (values.py), the tier."""
