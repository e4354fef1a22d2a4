"""SGLang's native API (/generate and its companions)."""
