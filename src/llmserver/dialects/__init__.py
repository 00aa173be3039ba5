"""The Anthropic Messages and OpenAI Responses APIs, spoken by translating to and from chat."""
