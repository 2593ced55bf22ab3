"""The speculative methods' names and DSpark's scheduler names: data every part reads, with no behaviour."""

SPEC_OFF, SPEC_NGRAM, SPEC_EAGLE3, SPEC_DFLASH, SPEC_DSPARK = "off", "ngram", "eagle3", "dflash", "dspark"
SPEC_GEMMA4_MTP, SPEC_MTP = "gemma4_mtp", "mtp"
SPEC_METHODS = (SPEC_OFF, SPEC_NGRAM, SPEC_EAGLE3, SPEC_DFLASH, SPEC_DSPARK, SPEC_GEMMA4_MTP, SPEC_MTP)
# Methods with a draft engine (ENGINEDIR/draft). Standard MTP (a layer of the base's own checkpoint) is named so that
# it can be refused clearly: the support matrix rejects it on attention-only bases, and its hybrid row is not built.
DRAFT_METHODS = (SPEC_EAGLE3, SPEC_DFLASH, SPEC_DSPARK, SPEC_GEMMA4_MTP, SPEC_MTP)
METHOD_NAMES = {SPEC_EAGLE3: "EAGLE3", SPEC_DFLASH: "DFlash", SPEC_DSPARK: "DSpark", SPEC_GEMMA4_MTP: "Gemma4 MTP",
                SPEC_MTP: "MTP"}
# DSpark's proposal-length schedulers (TensorRT Edge-LLM's --dsparkScheduler values; block_draft.py).
SCHEDULER_OFF, SCHEDULER_THRESHOLD, SCHEDULER_SPS = "off", "threshold", "sps"
DSPARK_SCHEDULERS = (SCHEDULER_OFF, SCHEDULER_THRESHOLD, SCHEDULER_SPS)
