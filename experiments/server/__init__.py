"""llm_serve: throughput, load, admission of huge requests and bodies, structured output's cost."""
