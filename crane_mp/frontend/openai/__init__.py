"""OpenAI's API: chat and text completions, embeddings, and the tokenize routes."""
