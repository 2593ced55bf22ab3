"""llm_profile: read, compare and plot the profile JSON that `llm_inference --profileOutputFile` writes."""
