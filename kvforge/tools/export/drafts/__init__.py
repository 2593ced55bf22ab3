"""Draft exporters: EAGLE3, block drafts (DFlash, DSpark), Gemma4 assistants, Qwen3.5 MTP, and their shared parts
(`common`)."""
