"""Data package: the committed golden vectors (``keys_v<HASH_VERSION>.json``).

It is a package only so that installs carry the JSON files along.
"""
