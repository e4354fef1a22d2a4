"""OpenAI's Responses API, with its store of earlier responses."""
