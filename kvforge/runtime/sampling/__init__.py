"""Choosing tokens: the sampler (`sampler`) and the verification of drafted tokens (`rejection`)."""
