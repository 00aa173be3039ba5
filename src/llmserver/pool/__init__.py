"""The supervised pool of llama-server instances and the routing of requests to them."""
