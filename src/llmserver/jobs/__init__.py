"""Async jobs: client-encrypted results, single-read polling, webhooks, sync→async fallback."""
