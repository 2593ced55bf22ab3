"""The contract layer (errors, model and engine-dir config, page math, LoRA): imports no other kvforge layer."""
