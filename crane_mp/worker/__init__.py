"""Worker process: weights, paged KV cache, forward pass and batched sampling (token ids only, never text)."""
