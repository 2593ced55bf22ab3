"""Image and audio inputs: decoding, preprocessing, encoder engines, media identity and the encoder cache."""
