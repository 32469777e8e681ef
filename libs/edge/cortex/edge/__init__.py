"""One edge for every Cortex service: settings read from a file, the environment and flags
into the service's frozen config dataclass, and ``serve`` (logging, stop signals, exit codes).

- :mod:`cortex.edge.settings` — :class:`~cortex.edge.settings.SettingsSpec`, the loader
  generated from a config dataclass (names, precedence, aliases, unknown keys).
- :mod:`cortex.edge.convert` — plain data → typed values and dataclasses (the one builder),
  :class:`~cortex.edge.convert.SettingsError`.
- :mod:`cortex.edge.serve` — ``serve(...)`` and the logging flags of every service command.
- :mod:`cortex.edge.http` — ``start_ops_http``: an aiohttp ops app on a port (aiohttp is
  imported when it is called: only the services that serve one, which depend on it already).

Everything else here is the standard library and :mod:`cortex.telemetry`.
"""
