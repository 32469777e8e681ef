"""Cortex block keys and bit-exact replicas of the engines' block hashes.

- :mod:`cortex.hashing.keys`: the Cortex key chain (``HashDomain``, ``block_keys``).
- :mod:`cortex.hashing.engines`: vLLM / SGLang block hashes and the ints they publish.
- :mod:`cortex.hashing.media`: media items (vLLM multimodal extra keys) in block keys.
- :mod:`cortex.hashing.packing`: token / key byte layouts shared with the wire.
- :mod:`cortex.hashing.vectors`: golden vectors and the build self-check.
"""

from cortex.hashing.engines import (
    VLLM_DEFAULT_SEED,
    VLLM_HASH_ALGOS,
    ExtraKeys,
    engine_event_ints,
    sglang_event_int,
    sglang_page_hashes,
    sglang_salt_root,
    vllm_block_hashes,
    vllm_event_int,
    vllm_extra_keys,
    vllm_none_hash,
)
from cortex.hashing.keys import (
    HASH_VERSION,
    Engine,
    HashDomain,
    block_keys,
    domain_seed,
    lookahead_block_keys,
    lookahead_root,
    root_key,
)
from cortex.hashing.media import (
    BlockMedia,
    MediaSpan,
    media_block_keys,
    media_extra_keys,
    media_pairs,
    vllm_hash_extras,
)
from cortex.hashing.packing import (
    MAX_TOKEN,
    TokenInput,
    pack_keys,
    pack_tokens,
    token_list,
    unpack_keys,
    unpack_tokens,
)

__all__ = [
    "HASH_VERSION",
    "MAX_TOKEN",
    "VLLM_DEFAULT_SEED",
    "VLLM_HASH_ALGOS",
    "BlockMedia",
    "Engine",
    "ExtraKeys",
    "HashDomain",
    "MediaSpan",
    "TokenInput",
    "block_keys",
    "domain_seed",
    "engine_event_ints",
    "lookahead_block_keys",
    "lookahead_root",
    "media_block_keys",
    "media_extra_keys",
    "media_pairs",
    "pack_keys",
    "pack_tokens",
    "root_key",
    "sglang_event_int",
    "sglang_page_hashes",
    "sglang_salt_root",
    "token_list",
    "unpack_keys",
    "unpack_tokens",
    "vllm_block_hashes",
    "vllm_event_int",
    "vllm_extra_keys",
    "vllm_hash_extras",
    "vllm_none_hash",
]
