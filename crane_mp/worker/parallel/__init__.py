"""Tensor parallelism: worker ranks joined by torch.distributed, and shared-memory collectives on one host."""
