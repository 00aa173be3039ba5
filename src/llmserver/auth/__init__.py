"""API keys and who is calling."""
