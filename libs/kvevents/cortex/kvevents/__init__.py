"""The engines' KV-event wire format, shared by ingest (which decodes it) and the simulator
(which publishes it); docs/events.md.

- :mod:`cortex.kvevents.events`: the normalized model (``BlockStored``, …) and the engines'
  wire field order.
- :mod:`cortex.kvevents.codec`: msgpack payload ⇄ ``EventBatch`` (decode any released
  version, encode byte-exact per version).
- :mod:`cortex.kvevents.encoding`: the per-version encoder rules (``encode_batch``).
- :mod:`cortex.kvevents.frames`: ZMQ multipart frames (PUB, replay request and replies).
"""
