"""Speculative decoding: proposers that fill a sequence's draft tokens between steps (the base verifies them)."""
