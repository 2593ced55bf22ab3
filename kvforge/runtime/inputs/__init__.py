"""Requests in, sequences out: request files, checks, the tokenizer, chat templates, media and the input processor."""
