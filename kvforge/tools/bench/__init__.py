"""llm_bench: kvforge engines against each other and against peer engines on the same workloads, in one run."""
