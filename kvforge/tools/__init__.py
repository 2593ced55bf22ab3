"""User tools beside the runtime: llm_export and its model-family graph builders."""
