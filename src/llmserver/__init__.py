"""llmserver: a self-hosted, multi-tenant server for GGUF language models on llama.cpp."""

__version__ = "0.1.0"
