"""Quantized (GGUF) weights: block formats, layers that compute on them, and the GGUF loader."""
