"""Cortex block keys and bit-exact replicas of the engines' block hashes."""

from cortex.hashing.keys import HASH_VERSION, Engine, HashDomain, block_keys, domain_seed, root_key

__all__ = ["HASH_VERSION", "Engine", "HashDomain", "block_keys", "domain_seed", "root_key"]
