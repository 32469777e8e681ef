from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EngineKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ENGINE_KIND_UNSPECIFIED: _ClassVar[EngineKind]
    ENGINE_KIND_SGLANG: _ClassVar[EngineKind]
    ENGINE_KIND_VLLM: _ClassVar[EngineKind]

class LedgerState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LEDGER_STATE_UNSPECIFIED: _ClassVar[LedgerState]
    LEDGER_STATE_SYNCING: _ClassVar[LedgerState]
    LEDGER_STATE_READY: _ClassVar[LedgerState]
    LEDGER_STATE_STALE: _ClassVar[LedgerState]
    LEDGER_STATE_REMOVED: _ClassVar[LedgerState]
    LEDGER_STATE_MISALIGNED: _ClassVar[LedgerState]

class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_DEVICE: _ClassVar[Tier]
    TIER_HOST: _ClassVar[Tier]
    TIER_DISK: _ClassVar[Tier]
    TIER_SHARED: _ClassVar[Tier]
ENGINE_KIND_UNSPECIFIED: EngineKind
ENGINE_KIND_SGLANG: EngineKind
ENGINE_KIND_VLLM: EngineKind
LEDGER_STATE_UNSPECIFIED: LedgerState
LEDGER_STATE_SYNCING: LedgerState
LEDGER_STATE_READY: LedgerState
LEDGER_STATE_STALE: LedgerState
LEDGER_STATE_REMOVED: LedgerState
LEDGER_STATE_MISALIGNED: LedgerState
TIER_DEVICE: Tier
TIER_HOST: Tier
TIER_DISK: Tier
TIER_SHARED: Tier

class Domain(_message.Message):
    __slots__ = ("model", "block_size", "engine")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    model: str
    block_size: int
    engine: EngineKind
    def __init__(self, model: _Optional[str] = ..., block_size: _Optional[int] = ..., engine: _Optional[_Union[EngineKind, str]] = ...) -> None: ...

class Source(_message.Message):
    __slots__ = ("worker_id", "dp_rank", "tier")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    DP_RANK_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    dp_rank: int
    tier: Tier
    def __init__(self, worker_id: _Optional[str] = ..., dp_rank: _Optional[int] = ..., tier: _Optional[_Union[Tier, str]] = ...) -> None: ...

class MatchRequest(_message.Message):
    __slots__ = ("model", "token_ids", "block_keys", "candidate_workers", "max_blocks", "block_size", "engine", "lora_name", "cache_salt", "token_ids_le", "block_keys_le")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_KEYS_FIELD_NUMBER: _ClassVar[int]
    CANDIDATE_WORKERS_FIELD_NUMBER: _ClassVar[int]
    MAX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_LE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_KEYS_LE_FIELD_NUMBER: _ClassVar[int]
    model: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    block_keys: _containers.RepeatedScalarFieldContainer[int]
    candidate_workers: _containers.RepeatedScalarFieldContainer[str]
    max_blocks: int
    block_size: int
    engine: EngineKind
    lora_name: str
    cache_salt: str
    token_ids_le: bytes
    block_keys_le: bytes
    def __init__(self, model: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., block_keys: _Optional[_Iterable[int]] = ..., candidate_workers: _Optional[_Iterable[str]] = ..., max_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., engine: _Optional[_Union[EngineKind, str]] = ..., lora_name: _Optional[str] = ..., cache_salt: _Optional[str] = ..., token_ids_le: _Optional[bytes] = ..., block_keys_le: _Optional[bytes] = ...) -> None: ...

class TierMatch(_message.Message):
    __slots__ = ("tier", "blocks", "tokens", "state")
    TIER_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    tier: Tier
    blocks: int
    tokens: int
    state: LedgerState
    def __init__(self, tier: _Optional[_Union[Tier, str]] = ..., blocks: _Optional[int] = ..., tokens: _Optional[int] = ..., state: _Optional[_Union[LedgerState, str]] = ...) -> None: ...

class WorkerMatch(_message.Message):
    __slots__ = ("worker_id", "matched_blocks", "matched_tokens", "state", "dp_rank", "tiers")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    MATCHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    DP_RANK_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    matched_blocks: int
    matched_tokens: int
    state: LedgerState
    dp_rank: int
    tiers: _containers.RepeatedCompositeFieldContainer[TierMatch]
    def __init__(self, worker_id: _Optional[str] = ..., matched_blocks: _Optional[int] = ..., matched_tokens: _Optional[int] = ..., state: _Optional[_Union[LedgerState, str]] = ..., dp_rank: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[TierMatch, _Mapping]]] = ...) -> None: ...

class MatchResponse(_message.Message):
    __slots__ = ("matches", "index_version", "query_blocks", "domain", "shared_blocks")
    MATCHES_FIELD_NUMBER: _ClassVar[int]
    INDEX_VERSION_FIELD_NUMBER: _ClassVar[int]
    QUERY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DOMAIN_FIELD_NUMBER: _ClassVar[int]
    SHARED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    matches: _containers.RepeatedCompositeFieldContainer[WorkerMatch]
    index_version: int
    query_blocks: int
    domain: Domain
    shared_blocks: int
    def __init__(self, matches: _Optional[_Iterable[_Union[WorkerMatch, _Mapping]]] = ..., index_version: _Optional[int] = ..., query_blocks: _Optional[int] = ..., domain: _Optional[_Union[Domain, _Mapping]] = ..., shared_blocks: _Optional[int] = ...) -> None: ...

class StoreBlocks(_message.Message):
    __slots__ = ("parent_key", "keys", "keys_le")
    PARENT_KEY_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    KEYS_LE_FIELD_NUMBER: _ClassVar[int]
    parent_key: int
    keys: _containers.RepeatedScalarFieldContainer[int]
    keys_le: bytes
    def __init__(self, parent_key: _Optional[int] = ..., keys: _Optional[_Iterable[int]] = ..., keys_le: _Optional[bytes] = ...) -> None: ...

class RemoveBlocks(_message.Message):
    __slots__ = ("keys", "keys_le")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    KEYS_LE_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[int]
    keys_le: bytes
    def __init__(self, keys: _Optional[_Iterable[int]] = ..., keys_le: _Optional[bytes] = ...) -> None: ...

class ClearBlocks(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class SetState(_message.Message):
    __slots__ = ("state", "reason")
    STATE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    state: LedgerState
    reason: str
    def __init__(self, state: _Optional[_Union[LedgerState, str]] = ..., reason: _Optional[str] = ...) -> None: ...

class Snapshot(_message.Message):
    __slots__ = ("parent_keys", "keys", "parent_keys_le", "keys_le", "state", "reason")
    PARENT_KEYS_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    PARENT_KEYS_LE_FIELD_NUMBER: _ClassVar[int]
    KEYS_LE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    parent_keys: _containers.RepeatedScalarFieldContainer[int]
    keys: _containers.RepeatedScalarFieldContainer[int]
    parent_keys_le: bytes
    keys_le: bytes
    state: LedgerState
    reason: str
    def __init__(self, parent_keys: _Optional[_Iterable[int]] = ..., keys: _Optional[_Iterable[int]] = ..., parent_keys_le: _Optional[bytes] = ..., keys_le: _Optional[bytes] = ..., state: _Optional[_Union[LedgerState, str]] = ..., reason: _Optional[str] = ...) -> None: ...

class RemoveSource(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class LedgerUpdate(_message.Message):
    __slots__ = ("source", "domain", "epoch", "seq", "store", "remove", "clear", "state", "snapshot", "remove_source")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    DOMAIN_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    STORE_FIELD_NUMBER: _ClassVar[int]
    REMOVE_FIELD_NUMBER: _ClassVar[int]
    CLEAR_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    REMOVE_SOURCE_FIELD_NUMBER: _ClassVar[int]
    source: Source
    domain: Domain
    epoch: int
    seq: int
    store: StoreBlocks
    remove: RemoveBlocks
    clear: ClearBlocks
    state: SetState
    snapshot: Snapshot
    remove_source: RemoveSource
    def __init__(self, source: _Optional[_Union[Source, _Mapping]] = ..., domain: _Optional[_Union[Domain, _Mapping]] = ..., epoch: _Optional[int] = ..., seq: _Optional[int] = ..., store: _Optional[_Union[StoreBlocks, _Mapping]] = ..., remove: _Optional[_Union[RemoveBlocks, _Mapping]] = ..., clear: _Optional[_Union[ClearBlocks, _Mapping]] = ..., state: _Optional[_Union[SetState, _Mapping]] = ..., snapshot: _Optional[_Union[Snapshot, _Mapping]] = ..., remove_source: _Optional[_Union[RemoveSource, _Mapping]] = ...) -> None: ...

class UpdateBatch(_message.Message):
    __slots__ = ("ingest_id", "updates", "quiet")
    INGEST_ID_FIELD_NUMBER: _ClassVar[int]
    UPDATES_FIELD_NUMBER: _ClassVar[int]
    QUIET_FIELD_NUMBER: _ClassVar[int]
    ingest_id: str
    updates: _containers.RepeatedCompositeFieldContainer[LedgerUpdate]
    quiet: bool
    def __init__(self, ingest_id: _Optional[str] = ..., updates: _Optional[_Iterable[_Union[LedgerUpdate, _Mapping]]] = ..., quiet: _Optional[bool] = ...) -> None: ...

class SyncReply(_message.Message):
    __slots__ = ("applied_batches", "index_version", "resync", "index_id")
    APPLIED_BATCHES_FIELD_NUMBER: _ClassVar[int]
    INDEX_VERSION_FIELD_NUMBER: _ClassVar[int]
    RESYNC_FIELD_NUMBER: _ClassVar[int]
    INDEX_ID_FIELD_NUMBER: _ClassVar[int]
    applied_batches: int
    index_version: int
    resync: _containers.RepeatedCompositeFieldContainer[Source]
    index_id: str
    def __init__(self, applied_batches: _Optional[int] = ..., index_version: _Optional[int] = ..., resync: _Optional[_Iterable[_Union[Source, _Mapping]]] = ..., index_id: _Optional[str] = ...) -> None: ...

class WorkersRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("source", "domain", "state", "reason", "blocks", "epoch", "seq", "updated_unix_s")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    DOMAIN_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    UPDATED_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    source: Source
    domain: Domain
    state: LedgerState
    reason: str
    blocks: int
    epoch: int
    seq: int
    updated_unix_s: float
    def __init__(self, source: _Optional[_Union[Source, _Mapping]] = ..., domain: _Optional[_Union[Domain, _Mapping]] = ..., state: _Optional[_Union[LedgerState, str]] = ..., reason: _Optional[str] = ..., blocks: _Optional[int] = ..., epoch: _Optional[int] = ..., seq: _Optional[int] = ..., updated_unix_s: _Optional[float] = ...) -> None: ...

class WorkersResponse(_message.Message):
    __slots__ = ("workers", "index_version")
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    INDEX_VERSION_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerInfo]
    index_version: int
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerInfo, _Mapping]]] = ..., index_version: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DomainStats(_message.Message):
    __slots__ = ("domain", "blocks", "holdings", "sources")
    DOMAIN_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HOLDINGS_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    domain: Domain
    blocks: int
    holdings: int
    sources: int
    def __init__(self, domain: _Optional[_Union[Domain, _Mapping]] = ..., blocks: _Optional[int] = ..., holdings: _Optional[int] = ..., sources: _Optional[int] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("blocks", "holdings", "bytes_estimate", "bytes_budget", "evictions", "index_version", "domains", "index_id")
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HOLDINGS_FIELD_NUMBER: _ClassVar[int]
    BYTES_ESTIMATE_FIELD_NUMBER: _ClassVar[int]
    BYTES_BUDGET_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    INDEX_VERSION_FIELD_NUMBER: _ClassVar[int]
    DOMAINS_FIELD_NUMBER: _ClassVar[int]
    INDEX_ID_FIELD_NUMBER: _ClassVar[int]
    blocks: int
    holdings: int
    bytes_estimate: int
    bytes_budget: int
    evictions: int
    index_version: int
    domains: _containers.RepeatedCompositeFieldContainer[DomainStats]
    index_id: str
    def __init__(self, blocks: _Optional[int] = ..., holdings: _Optional[int] = ..., bytes_estimate: _Optional[int] = ..., bytes_budget: _Optional[int] = ..., evictions: _Optional[int] = ..., index_version: _Optional[int] = ..., domains: _Optional[_Iterable[_Union[DomainStats, _Mapping]]] = ..., index_id: _Optional[str] = ...) -> None: ...

class ChangesRequest(_message.Message):
    __slots__ = ("since_version", "model")
    SINCE_VERSION_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    since_version: int
    model: str
    def __init__(self, since_version: _Optional[int] = ..., model: _Optional[str] = ...) -> None: ...

class ChangeBatch(_message.Message):
    __slots__ = ("from_version", "to_version", "domain", "removed_blocks_sources", "removed_keys", "removed_keys_le", "cleared_sources", "reset")
    FROM_VERSION_FIELD_NUMBER: _ClassVar[int]
    TO_VERSION_FIELD_NUMBER: _ClassVar[int]
    DOMAIN_FIELD_NUMBER: _ClassVar[int]
    REMOVED_BLOCKS_SOURCES_FIELD_NUMBER: _ClassVar[int]
    REMOVED_KEYS_FIELD_NUMBER: _ClassVar[int]
    REMOVED_KEYS_LE_FIELD_NUMBER: _ClassVar[int]
    CLEARED_SOURCES_FIELD_NUMBER: _ClassVar[int]
    RESET_FIELD_NUMBER: _ClassVar[int]
    from_version: int
    to_version: int
    domain: Domain
    removed_blocks_sources: _containers.RepeatedCompositeFieldContainer[Source]
    removed_keys: _containers.RepeatedScalarFieldContainer[int]
    removed_keys_le: bytes
    cleared_sources: _containers.RepeatedCompositeFieldContainer[Source]
    reset: bool
    def __init__(self, from_version: _Optional[int] = ..., to_version: _Optional[int] = ..., domain: _Optional[_Union[Domain, _Mapping]] = ..., removed_blocks_sources: _Optional[_Iterable[_Union[Source, _Mapping]]] = ..., removed_keys: _Optional[_Iterable[int]] = ..., removed_keys_le: _Optional[bytes] = ..., cleared_sources: _Optional[_Iterable[_Union[Source, _Mapping]]] = ..., reset: _Optional[bool] = ...) -> None: ...

class ReplicaRequest(_message.Message):
    __slots__ = ("models", "replica_id", "touched")
    MODELS_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    TOUCHED_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedScalarFieldContainer[str]
    replica_id: str
    touched: _containers.RepeatedCompositeFieldContainer[ReplicaTouch]
    def __init__(self, models: _Optional[_Iterable[str]] = ..., replica_id: _Optional[str] = ..., touched: _Optional[_Iterable[_Union[ReplicaTouch, _Mapping]]] = ...) -> None: ...

class ReplicaTouch(_message.Message):
    __slots__ = ("domain", "keys_le")
    DOMAIN_FIELD_NUMBER: _ClassVar[int]
    KEYS_LE_FIELD_NUMBER: _ClassVar[int]
    domain: Domain
    keys_le: bytes
    def __init__(self, domain: _Optional[_Union[Domain, _Mapping]] = ..., keys_le: _Optional[bytes] = ...) -> None: ...

class ReplicaSource(_message.Message):
    __slots__ = ("source", "domain", "state", "reason", "bit")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    DOMAIN_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    BIT_FIELD_NUMBER: _ClassVar[int]
    source: Source
    domain: Domain
    state: LedgerState
    reason: str
    bit: int
    def __init__(self, source: _Optional[_Union[Source, _Mapping]] = ..., domain: _Optional[_Union[Domain, _Mapping]] = ..., state: _Optional[_Union[LedgerState, str]] = ..., reason: _Optional[str] = ..., bit: _Optional[int] = ...) -> None: ...

class TreeChunk(_message.Message):
    __slots__ = ("domain", "slots", "words", "first_slot", "keys_le", "parents_le", "holders_le")
    DOMAIN_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    WORDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_SLOT_FIELD_NUMBER: _ClassVar[int]
    KEYS_LE_FIELD_NUMBER: _ClassVar[int]
    PARENTS_LE_FIELD_NUMBER: _ClassVar[int]
    HOLDERS_LE_FIELD_NUMBER: _ClassVar[int]
    domain: Domain
    slots: int
    words: int
    first_slot: int
    keys_le: bytes
    parents_le: bytes
    holders_le: bytes
    def __init__(self, domain: _Optional[_Union[Domain, _Mapping]] = ..., slots: _Optional[int] = ..., words: _Optional[int] = ..., first_slot: _Optional[int] = ..., keys_le: _Optional[bytes] = ..., parents_le: _Optional[bytes] = ..., holders_le: _Optional[bytes] = ...) -> None: ...

class StorePairs(_message.Message):
    __slots__ = ("parent_keys_le", "keys_le")
    PARENT_KEYS_LE_FIELD_NUMBER: _ClassVar[int]
    KEYS_LE_FIELD_NUMBER: _ClassVar[int]
    parent_keys_le: bytes
    keys_le: bytes
    def __init__(self, parent_keys_le: _Optional[bytes] = ..., keys_le: _Optional[bytes] = ...) -> None: ...

class EvictBlocks(_message.Message):
    __slots__ = ("domain", "keys_le")
    DOMAIN_FIELD_NUMBER: _ClassVar[int]
    KEYS_LE_FIELD_NUMBER: _ClassVar[int]
    domain: Domain
    keys_le: bytes
    def __init__(self, domain: _Optional[_Union[Domain, _Mapping]] = ..., keys_le: _Optional[bytes] = ...) -> None: ...

class ReplicaOp(_message.Message):
    __slots__ = ("source", "attach", "store", "store_pairs", "remove", "clear", "detach", "evict")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    ATTACH_FIELD_NUMBER: _ClassVar[int]
    STORE_FIELD_NUMBER: _ClassVar[int]
    STORE_PAIRS_FIELD_NUMBER: _ClassVar[int]
    REMOVE_FIELD_NUMBER: _ClassVar[int]
    CLEAR_FIELD_NUMBER: _ClassVar[int]
    DETACH_FIELD_NUMBER: _ClassVar[int]
    EVICT_FIELD_NUMBER: _ClassVar[int]
    source: Source
    attach: ReplicaSource
    store: StoreBlocks
    store_pairs: StorePairs
    remove: RemoveBlocks
    clear: ClearBlocks
    detach: RemoveSource
    evict: EvictBlocks
    def __init__(self, source: _Optional[_Union[Source, _Mapping]] = ..., attach: _Optional[_Union[ReplicaSource, _Mapping]] = ..., store: _Optional[_Union[StoreBlocks, _Mapping]] = ..., store_pairs: _Optional[_Union[StorePairs, _Mapping]] = ..., remove: _Optional[_Union[RemoveBlocks, _Mapping]] = ..., clear: _Optional[_Union[ClearBlocks, _Mapping]] = ..., detach: _Optional[_Union[RemoveSource, _Mapping]] = ..., evict: _Optional[_Union[EvictBlocks, _Mapping]] = ...) -> None: ...

class ReplicaBatch(_message.Message):
    __slots__ = ("index_id", "seq", "version", "snapshot", "synced", "sources", "trees", "ops", "applied_unix_s")
    INDEX_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    SYNCED_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    TREES_FIELD_NUMBER: _ClassVar[int]
    OPS_FIELD_NUMBER: _ClassVar[int]
    APPLIED_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    index_id: str
    seq: int
    version: int
    snapshot: bool
    synced: bool
    sources: _containers.RepeatedCompositeFieldContainer[ReplicaSource]
    trees: _containers.RepeatedCompositeFieldContainer[TreeChunk]
    ops: _containers.RepeatedCompositeFieldContainer[ReplicaOp]
    applied_unix_s: float
    def __init__(self, index_id: _Optional[str] = ..., seq: _Optional[int] = ..., version: _Optional[int] = ..., snapshot: _Optional[bool] = ..., synced: _Optional[bool] = ..., sources: _Optional[_Iterable[_Union[ReplicaSource, _Mapping]]] = ..., trees: _Optional[_Iterable[_Union[TreeChunk, _Mapping]]] = ..., ops: _Optional[_Iterable[_Union[ReplicaOp, _Mapping]]] = ..., applied_unix_s: _Optional[float] = ...) -> None: ...
