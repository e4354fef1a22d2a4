"""The one generation pipeline every API goes through: prompts rendered and tokenized, requests sent to
the engine, tokens detokenized, answers read (tool calls, reasoning, structured output) and streamed."""
