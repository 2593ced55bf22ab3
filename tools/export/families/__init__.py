"""Model families: one graph builder (and HF source) per architecture."""
