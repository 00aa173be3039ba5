"""Talking to llama-server, and translating our API to and from its wire format."""
