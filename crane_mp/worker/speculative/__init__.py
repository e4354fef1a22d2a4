"""Speculative decoding: proposers of the tokens a decode row verifies in one step (ngram, draft)."""
