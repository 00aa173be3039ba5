"""The cluster: nodes that run instances, gateways that route to them, and the scheduler."""
