"""Usage ledger, rolling speed per model, Prometheus metrics."""
