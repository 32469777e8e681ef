"""One edge for every Cortex service: settings read from a file, the environment and flags
into the service's frozen config dataclass, and ``serve`` (logging, stop signals, exit codes)."""
