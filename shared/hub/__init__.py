"""The Hub before any download: resolving a model, listing the tops, and sizing from metadata."""
