"""Native kernels, compiled on first use; every one has a portable torch fallback."""
