"""Benchmarks of llmserver against direct llama-server (see bench/throughput.py)."""
