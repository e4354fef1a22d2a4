"""crane-mp: a multi-process LLM inference server with OpenAI- and SGLang-compatible APIs."""

__version__ = "0.1.0"
