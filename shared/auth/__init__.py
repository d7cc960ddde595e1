"""Who may change state through the API: bearer tokens, stored hashed, each with a scope."""
