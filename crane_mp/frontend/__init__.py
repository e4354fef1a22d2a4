"""Frontend process: HTTP (aiohttp), chat templates, tokenization, detokenization, stop strings, SSE. No torch."""
