"""Memory and caches: how many KV blocks fit (memory.py) and the paged attention that reads and writes them."""
