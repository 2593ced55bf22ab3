"""A GGUF's SentencePiece vocabulary (`tokenizer.ggml.model` "llama": Gemma 3, Llama 2, Mistral) as a Hugging Face
tokenizer.json, so a gemma3 GGUF tokenizes as its HF dir does; the file stores pieces and scores but no merges."""

from __future__ import annotations

from typing import Any

# llama.cpp token types (gguf.TokenType).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
SPACE = "\u2581"  # SentencePiece's visible space


def spm_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece's score-ordered merging, which llama.cpp's SPM tokenizer runs.

    SentencePiece BPE joins, at each step, the adjacent pair whose joined piece scores highest. A BPE model applies
    the pair of lowest merge rank, so every split of every normal piece into two normal pieces becomes a merge ranked
    by the joined piece's score (highest first); ties keep the vocabulary's order, then the split's position.
    """
    normal = {tok for tok, kind in zip(tokens, types, strict=True) if kind == NORMAL}
    ranked: list[tuple[float, int, int, str, str]] = []
    for index, (piece, score, kind) in enumerate(zip(tokens, scores, types, strict=True)):
        if kind != NORMAL or len(piece) < 2:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in normal and right in normal:
                ranked.append((-score, index, cut, left, right))
    ranked.sort()
    return [(left, right) for _, _, _, left, right in ranked]


def spm_tokenizer_json(tokens: list[str], scores: list[float], types: list[int], bos: int | None,
                       add_bos: bool, add_space_prefix: bool) -> str:
    """tokenizer.json of a SentencePiece BPE vocabulary: spaces as U+2581 (a leading one only when the file says
    add_space_prefix), unknown bytes as their <0xNN> pieces, control and user-defined pieces matched whole."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, processors

    vocab = {tok: i for i, tok in reversed(list(enumerate(tokens)))}  # first id wins on duplicates
    unk = next((tokens[i] for i, kind in enumerate(types) if kind == UNKNOWN), None)
    model = models.BPE(vocab, spm_merges(tokens, scores, types), unk_token=unk, fuse_unk=True, byte_fallback=True)
    tokenizer = Tokenizer(model)
    steps: list[Any] = [normalizers.Prepend(SPACE)] if add_space_prefix else []
    tokenizer.normalizer = normalizers.Sequence([*steps, normalizers.Replace(Regex(" "), SPACE)])
    strip = [decoders.Strip(" ", 1, 0)] if add_space_prefix else []  # the prepended space is not the text's
    tokenizer.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse(),
                                           *strip])
    tokenizer.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                          for i, kind in enumerate(types) if kind == USER_DEFINED])
    tokenizer.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                  for i, kind in enumerate(types) if kind in (CONTROL, UNKNOWN)])
    if add_bos and bos is not None:
        bos_text = tokens[bos]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos_text} $A", pair=f"{bos_text} $A {bos_text} $B:1", special_tokens=[(bos_text, bos)])
    return tokenizer.to_str()
