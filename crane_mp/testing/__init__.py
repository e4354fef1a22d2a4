"""Helpers for tests, benchmarks and the demo: tiny seeded model checkpoints."""
