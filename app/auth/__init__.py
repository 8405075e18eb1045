"""API keys: hashed secrets, roles, per-key rate limits, and their management."""
