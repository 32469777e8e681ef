"""Generated: cortex.index.v1."""
