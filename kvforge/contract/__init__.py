"""The contract layer (errors, model and engine-dir config, page geometry, LoRA): imports no other kvforge layer."""
