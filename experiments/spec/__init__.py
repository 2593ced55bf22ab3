"""Speculative decoding: prompt lookup, EAGLE3, block drafts, MTP, and what a verify row costs."""
