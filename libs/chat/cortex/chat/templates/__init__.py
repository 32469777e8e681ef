"""Package data: the chat templates (a package only so that installs carry them)."""
