"""Test and demo support that needs no network: tiny checkpoints, a Hub stand-in, local services."""
