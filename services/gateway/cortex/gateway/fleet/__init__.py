"""The live worker pool and what keeps it true: breakers, health probes, engine-reported load,
seeding by URL, engine limits.
"""
