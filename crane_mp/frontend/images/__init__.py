"""Images in chat: fetching and decoding image parts, and the model's image processor."""
