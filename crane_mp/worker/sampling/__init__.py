"""Batched sampling and the per-request state it keeps: penalties, seeded noise, grammar matchers, Whisper's
logits rules."""
