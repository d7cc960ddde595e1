"""The HTTP API: submit jobs, follow them, read results."""
