"""llm_test: runs request files against an engine and checks what each file declares (ROUGE, counters, identities)."""
