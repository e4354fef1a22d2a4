"""Scheduler process: requests, KV block allocator and continuous batching. Plain Python: never imports torch."""
