"""Package data: the chat templates shipped with ``cortex.chat`` (a package so installs carry them)."""
