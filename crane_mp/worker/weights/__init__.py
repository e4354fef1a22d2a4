"""Weights into the model: checkpoint loading and its progress, bf16 packing for the CPU's matrix units,
LoRA adapters."""
