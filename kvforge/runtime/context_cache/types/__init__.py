"""The cache types, one module each: what a type stores, how it finds a hit, restores and publishes, and its counters.

The coordinator (`..manager`) knows them only through `..registry`; a new type is a module here and one `register` call.
"""
