"""Wire models: what clients send, validated at the gateway before anything reaches an instance."""
