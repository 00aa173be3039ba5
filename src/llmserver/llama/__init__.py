"""Talking to llama-server: the one client, its wire, its event streams and its flags."""
