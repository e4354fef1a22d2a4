"""Scoring and reranking: /v1/score, /v1/rerank (Cohere and Jina shapes)."""
