"""llm_export's help texts for the draft and adapter commands, kept apart so cli.py reads as the commands."""

EAGLE3_HELP = """
Export an EAGLE3 draft in the Hugging Face format (LlamaForCausalLMEagle3: fc over three base layers' hidden
states, one decoder layer, a reduced vocabulary with its d2t map) for the base whose ONNX dir is given. The base
must return the hidden states the draft reads: export it with --hiddenStateLayers (this command says which).
Build both with llm_build --specBase / --specDraft into one engine dir and run llm_inference --specDecode eagle3.

[bold]Example[/]

  llm_export eagle3 --draftDir my_eagle3_draft --baseOnnxDir onnx/smollm2-base --outputDir onnx/smollm2-draft
"""
RANDOM_EAGLE3_HELP = """
Write a random-weight EAGLE3 draft checkpoint (Hugging Face format) for the base of an ONNX dir: plumbing tests
and demos (its proposals are rarely accepted); export it with `eagle3`.

[bold]Example[/]

  llm_export random-eagle3 --baseOnnxDir onnx/tiny --outputDir drafts/random_eagle3 --draftVocab 64
"""
BLOCK_DRAFT_HELP = """
Export a block draft (DFlash's DFlashDraftModel or DSpark's DSparkDraftModel, Hugging Face format) for a base ONNX
dir. The base must return the hidden states of the draft's dflash_config.target_layer_ids (llm_export
--hiddenStateLayers); the draft embeds with the base's table and scores with a float copy of the base's LM head.
Build it with `llm_build --specDraft --cpuAttention kernel` into the base engine's draft/ folder.

[bold]Example[/]

  llm_export model HF/Qwen3-4B --hiddenStateLayers 1,9,17,25,33 --outputDir onnx/qwen3-4b
  llm_export block-draft --draftDir HF/Qwen3-4B-DFlash-b16 --baseOnnxDir onnx/qwen3-4b --outputDir onnx/dflash
"""
RANDOM_BLOCK_DRAFT_HELP = """
Write a random-weight DFlash or DSpark checkpoint (Hugging Face format) for the base of an ONNX dir: plumbing tests
and demos (its proposals are rarely accepted); export it with `block-draft`.

[bold]Example[/]

  llm_export random-block-draft --kind dspark --baseOnnxDir onnx/tiny --outputDir drafts/random_dspark
"""
GEMMA4_ASSISTANT_HELP = """
Export a Gemma4 MTP assistant (transformers' Gemma4AssistantForCausalLM, Hugging Face format) for a base ONNX dir.
Its layers have query projections only and attend over the K/V the base wrote (no draft pool); it reads the base's
normed last hidden state, so the base must return its last layer (llm_export --hiddenStateLayers N-1). Over a
Gemma 4 base its sliding and global layers read the base's last sliding and global layers; over a llama-style base
it has full-attention layers only; RoPE, window and head size must be the base's. Build it with `llm_build
--specDraft --cpuAttention kernel` (the base's --tokensPerPage) into the base engine's draft/ folder and run with
`llm_inference --specDecode gemma4_mtp`.

[bold]Example[/]

  llm_export model --synthetic tiny-llama --hiddenStateLayers 1 --outputDir onnx/tiny
  llm_export random-gemma4-assistant --baseOnnxDir onnx/tiny --outputDir drafts/assistant
  llm_export gemma4-assistant --draftDir drafts/assistant --baseOnnxDir onnx/tiny --outputDir onnx/assistant
"""
RANDOM_GEMMA4_ASSISTANT_HELP = """
Write a random-weight Gemma4 assistant checkpoint (Hugging Face format) for the base of an ONNX dir: plumbing tests
and demos (its guesses are rarely accepted); export it with `gemma4-assistant`.

[bold]Example[/]

  llm_export random-gemma4-assistant --baseOnnxDir onnx/tiny --outputDir drafts/assistant --numCentroids 7
"""
MTP_HELP = """
Export the multi-token-prediction layer of a Qwen3.5 checkpoint (its `mtp.*` tensors) as a draft for that model's
ONNX dir: standard MTP on a hybrid base. The base must return its last layer (llm_export --hiddenStateLayers N-1);
the draft embeds with the base's table and scores with a float copy of its head. Build it with `llm_build
--specDraft` into the base engine's draft/ folder (the base with --specBase) and run `llm_inference --specDecode
mtp`.

[bold]Example[/]

  llm_export model HF/Qwen3.5-0.8B --hiddenStateLayers 23 --outputDir onnx/qwen3_5
  llm_export mtp --draftDir HF/Qwen3.5-0.8B --baseOnnxDir onnx/qwen3_5 --outputDir onnx/qwen3_5-mtp
"""
RANDOM_MTP_HELP = """
Write a random Qwen3.5 MTP layer (`mtp.*` tensors and a config.json, the checkpoint's layout) for a hybrid base's
ONNX dir: plumbing tests and demos (its guesses are rarely accepted); export it with `mtp`.

[bold]Example[/]

  llm_export model --synthetic tiny-qwen3_5 --hiddenStateLayers 3 --outputDir onnx/tiny-hybrid
  llm_export random-mtp --baseOnnxDir onnx/tiny-hybrid --outputDir drafts/mtp
"""
LORA_HELP = """
Convert a PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors) into the engine's layout
(A as [in, r], B as [r, out], alpha/r folded into B), checking every shape against the ONNX dir's model.

[bold]Example[/]

  llm_export lora --adapterDir my_peft_adapter --onnxDir onnx/smollm2 --output adapters/mine.safetensors
"""
RANDOM_LORA_HELP = """
Write a random PEFT adapter for the model of an ONNX dir (for tests and demos); convert it with `lora`.

[bold]Example[/]

  llm_export random-lora --onnxDir onnx/smollm2 --outputDir adapters/random_peft --rank 8 --seed 1
"""
