"""The server's own routes: health, model and server info, metrics, cache flush, LoRA adapters."""
