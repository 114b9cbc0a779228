from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    FLOAT32: _ClassVar[DType]
    FLOAT16: _ClassVar[DType]
    BFLOAT16: _ClassVar[DType]

class Encoding(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DENSE: _ClassVar[Encoding]
    TOPK: _ClassVar[Encoding]
    LOWRANK: _ClassVar[Encoding]
DTYPE_UNSPECIFIED: DType
FLOAT32: DType
FLOAT16: DType
BFLOAT16: DType
DENSE: Encoding
TOPK: Encoding
LOWRANK: Encoding

class OptimizerSpec(_message.Message):
    __slots__ = ("name", "params_json")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PARAMS_JSON_FIELD_NUMBER: _ClassVar[int]
    name: str
    params_json: str
    def __init__(self, name: _Optional[str] = ..., params_json: _Optional[str] = ...) -> None: ...

class Part(_message.Message):
    __slots__ = ("start", "stop")
    START_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    start: int
    stop: int
    def __init__(self, start: _Optional[int] = ..., stop: _Optional[int] = ...) -> None: ...

class TensorSpec(_message.Message):
    __slots__ = ("name", "shape", "dtype", "optimizer", "parts", "grad_dtype", "peers", "holders")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    GRAD_DTYPE_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    HOLDERS_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: DType
    optimizer: OptimizerSpec
    parts: _containers.RepeatedCompositeFieldContainer[Part]
    grad_dtype: DType
    peers: _containers.RepeatedScalarFieldContainer[str]
    holders: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[_Union[DType, str]] = ..., optimizer: _Optional[_Union[OptimizerSpec, _Mapping]] = ..., parts: _Optional[_Iterable[_Union[Part, _Mapping]]] = ..., grad_dtype: _Optional[_Union[DType, str]] = ..., peers: _Optional[_Iterable[str]] = ..., holders: _Optional[_Iterable[int]] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("name", "offset", "dtype", "data", "shape", "shm_offset", "shm_bytes", "encoding", "numel", "indices", "rank", "factor")
    NAME_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    SHM_OFFSET_FIELD_NUMBER: _ClassVar[int]
    SHM_BYTES_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    INDICES_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    FACTOR_FIELD_NUMBER: _ClassVar[int]
    name: str
    offset: int
    dtype: DType
    data: bytes
    shape: _containers.RepeatedScalarFieldContainer[int]
    shm_offset: int
    shm_bytes: int
    encoding: Encoding
    numel: int
    indices: bytes
    rank: int
    factor: bytes
    def __init__(self, name: _Optional[str] = ..., offset: _Optional[int] = ..., dtype: _Optional[_Union[DType, str]] = ..., data: _Optional[bytes] = ..., shape: _Optional[_Iterable[int]] = ..., shm_offset: _Optional[int] = ..., shm_bytes: _Optional[int] = ..., encoding: _Optional[_Union[Encoding, str]] = ..., numel: _Optional[int] = ..., indices: _Optional[bytes] = ..., rank: _Optional[int] = ..., factor: _Optional[bytes] = ...) -> None: ...

class LossScaling(_message.Message):
    __slots__ = ("enabled", "init_scale", "growth_factor", "backoff_factor", "growth_interval")
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    INIT_SCALE_FIELD_NUMBER: _ClassVar[int]
    GROWTH_FACTOR_FIELD_NUMBER: _ClassVar[int]
    BACKOFF_FACTOR_FIELD_NUMBER: _ClassVar[int]
    GROWTH_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    init_scale: float
    growth_factor: float
    backoff_factor: float
    growth_interval: int
    def __init__(self, enabled: _Optional[bool] = ..., init_scale: _Optional[float] = ..., growth_factor: _Optional[float] = ..., backoff_factor: _Optional[float] = ..., growth_interval: _Optional[int] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("worker_id", "num_workers", "sync", "tensors", "chunk", "provides_values", "loss_scaling", "staleness_remedy", "shm_probe", "shm_token")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_WORKERS_FIELD_NUMBER: _ClassVar[int]
    SYNC_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    PROVIDES_VALUES_FIELD_NUMBER: _ClassVar[int]
    LOSS_SCALING_FIELD_NUMBER: _ClassVar[int]
    STALENESS_REMEDY_FIELD_NUMBER: _ClassVar[int]
    SHM_PROBE_FIELD_NUMBER: _ClassVar[int]
    SHM_TOKEN_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    num_workers: int
    sync: str
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    chunk: Chunk
    provides_values: bool
    loss_scaling: LossScaling
    staleness_remedy: str
    shm_probe: str
    shm_token: bytes
    def __init__(self, worker_id: _Optional[int] = ..., num_workers: _Optional[int] = ..., sync: _Optional[str] = ..., tensors: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ..., provides_values: _Optional[bool] = ..., loss_scaling: _Optional[_Union[LossScaling, _Mapping]] = ..., staleness_remedy: _Optional[str] = ..., shm_probe: _Optional[str] = ..., shm_token: _Optional[bytes] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("version", "shard_index", "num_shards", "sync", "created", "loss_scale", "worker_clock", "lease_seconds", "epoch", "backup", "shm", "sync_switch", "data_port", "data_token", "data_route", "fence_epoch", "skips", "ready_version")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    SYNC_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    LOSS_SCALE_FIELD_NUMBER: _ClassVar[int]
    WORKER_CLOCK_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    BACKUP_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    SYNC_SWITCH_FIELD_NUMBER: _ClassVar[int]
    DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    DATA_TOKEN_FIELD_NUMBER: _ClassVar[int]
    DATA_ROUTE_FIELD_NUMBER: _ClassVar[int]
    FENCE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    SKIPS_FIELD_NUMBER: _ClassVar[int]
    READY_VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    shard_index: int
    num_shards: int
    sync: str
    created: _containers.RepeatedScalarFieldContainer[str]
    loss_scale: float
    worker_clock: int
    lease_seconds: float
    epoch: int
    backup: str
    shm: bool
    sync_switch: int
    data_port: int
    data_token: bytes
    data_route: int
    fence_epoch: int
    skips: bool
    ready_version: int
    def __init__(self, version: _Optional[int] = ..., shard_index: _Optional[int] = ..., num_shards: _Optional[int] = ..., sync: _Optional[str] = ..., created: _Optional[_Iterable[str]] = ..., loss_scale: _Optional[float] = ..., worker_clock: _Optional[int] = ..., lease_seconds: _Optional[float] = ..., epoch: _Optional[int] = ..., backup: _Optional[str] = ..., shm: _Optional[bool] = ..., sync_switch: _Optional[int] = ..., data_port: _Optional[int] = ..., data_token: _Optional[bytes] = ..., data_route: _Optional[int] = ..., fence_epoch: _Optional[int] = ..., skips: _Optional[bool] = ..., ready_version: _Optional[int] = ...) -> None: ...

class RollbackRequest(_message.Message):
    __slots__ = ("version", "epoch")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    version: int
    epoch: int
    def __init__(self, version: _Optional[int] = ..., epoch: _Optional[int] = ...) -> None: ...

class RollbackResponse(_message.Message):
    __slots__ = ("version", "epoch")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    version: int
    epoch: int
    def __init__(self, version: _Optional[int] = ..., epoch: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("worker_id",)
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    def __init__(self, worker_id: _Optional[int] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("version", "live_workers", "backup")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LIVE_WORKERS_FIELD_NUMBER: _ClassVar[int]
    BACKUP_FIELD_NUMBER: _ClassVar[int]
    version: int
    live_workers: _containers.RepeatedScalarFieldContainer[int]
    backup: str
    def __init__(self, version: _Optional[int] = ..., live_workers: _Optional[_Iterable[int]] = ..., backup: _Optional[str] = ...) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("worker_id",)
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    def __init__(self, worker_id: _Optional[int] = ...) -> None: ...

class LeaveResponse(_message.Message):
    __slots__ = ("version", "live_workers")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LIVE_WORKERS_FIELD_NUMBER: _ClassVar[int]
    version: int
    live_workers: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, version: _Optional[int] = ..., live_workers: _Optional[_Iterable[int]] = ...) -> None: ...

class PushRequest(_message.Message):
    __slots__ = ("worker_id", "step", "base_version", "chunk", "found_inf", "loss_scale", "epoch", "shm", "ends_with_last", "last", "pull_after", "pull_dtype", "pull_min_clock", "slices", "sync", "sync_switch", "fence_epoch")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    FOUND_INF_FIELD_NUMBER: _ClassVar[int]
    LOSS_SCALE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    ENDS_WITH_LAST_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    PULL_AFTER_FIELD_NUMBER: _ClassVar[int]
    PULL_DTYPE_FIELD_NUMBER: _ClassVar[int]
    PULL_MIN_CLOCK_FIELD_NUMBER: _ClassVar[int]
    SLICES_FIELD_NUMBER: _ClassVar[int]
    SYNC_FIELD_NUMBER: _ClassVar[int]
    SYNC_SWITCH_FIELD_NUMBER: _ClassVar[int]
    FENCE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    step: int
    base_version: int
    chunk: Chunk
    found_inf: bool
    loss_scale: float
    epoch: int
    shm: str
    ends_with_last: bool
    last: bool
    pull_after: bool
    pull_dtype: DType
    pull_min_clock: int
    slices: _containers.RepeatedCompositeFieldContainer[TensorSlice]
    sync: str
    sync_switch: int
    fence_epoch: int
    def __init__(self, worker_id: _Optional[int] = ..., step: _Optional[int] = ..., base_version: _Optional[int] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ..., found_inf: _Optional[bool] = ..., loss_scale: _Optional[float] = ..., epoch: _Optional[int] = ..., shm: _Optional[str] = ..., ends_with_last: _Optional[bool] = ..., last: _Optional[bool] = ..., pull_after: _Optional[bool] = ..., pull_dtype: _Optional[_Union[DType, str]] = ..., pull_min_clock: _Optional[int] = ..., slices: _Optional[_Iterable[_Union[TensorSlice, _Mapping]]] = ..., sync: _Optional[str] = ..., sync_switch: _Optional[int] = ..., fence_epoch: _Optional[int] = ...) -> None: ...

class PushResponse(_message.Message):
    __slots__ = ("version", "applied", "duplicate", "sync", "loss_scale", "ready_version", "pulled", "sync_switch")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    SYNC_FIELD_NUMBER: _ClassVar[int]
    LOSS_SCALE_FIELD_NUMBER: _ClassVar[int]
    READY_VERSION_FIELD_NUMBER: _ClassVar[int]
    PULLED_FIELD_NUMBER: _ClassVar[int]
    SYNC_SWITCH_FIELD_NUMBER: _ClassVar[int]
    version: int
    applied: bool
    duplicate: bool
    sync: str
    loss_scale: float
    ready_version: int
    pulled: _containers.RepeatedScalarFieldContainer[bytes]
    sync_switch: int
    def __init__(self, version: _Optional[int] = ..., applied: _Optional[bool] = ..., duplicate: _Optional[bool] = ..., sync: _Optional[str] = ..., loss_scale: _Optional[float] = ..., ready_version: _Optional[int] = ..., pulled: _Optional[_Iterable[bytes]] = ..., sync_switch: _Optional[int] = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("worker_id", "names", "min_version", "dtype", "chunk_bytes", "min_clock", "epoch", "shm", "slices", "fence_epoch", "frame_bytes")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    NAMES_FIELD_NUMBER: _ClassVar[int]
    MIN_VERSION_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    MIN_CLOCK_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    SLICES_FIELD_NUMBER: _ClassVar[int]
    FENCE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    FRAME_BYTES_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    names: _containers.RepeatedScalarFieldContainer[str]
    min_version: int
    dtype: DType
    chunk_bytes: int
    min_clock: int
    epoch: int
    shm: str
    slices: _containers.RepeatedCompositeFieldContainer[TensorSlice]
    fence_epoch: int
    frame_bytes: int
    def __init__(self, worker_id: _Optional[int] = ..., names: _Optional[_Iterable[str]] = ..., min_version: _Optional[int] = ..., dtype: _Optional[_Union[DType, str]] = ..., chunk_bytes: _Optional[int] = ..., min_clock: _Optional[int] = ..., epoch: _Optional[int] = ..., shm: _Optional[str] = ..., slices: _Optional[_Iterable[_Union[TensorSlice, _Mapping]]] = ..., fence_epoch: _Optional[int] = ..., frame_bytes: _Optional[int] = ...) -> None: ...

class TensorSlice(_message.Message):
    __slots__ = ("name", "dim", "parts", "index", "blocks")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    name: str
    dim: int
    parts: int
    index: int
    blocks: int
    def __init__(self, name: _Optional[str] = ..., dim: _Optional[int] = ..., parts: _Optional[int] = ..., index: _Optional[int] = ..., blocks: _Optional[int] = ...) -> None: ...

class PullResponse(_message.Message):
    __slots__ = ("version", "chunk", "loss_scale", "sync", "slowest_clock")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    LOSS_SCALE_FIELD_NUMBER: _ClassVar[int]
    SYNC_FIELD_NUMBER: _ClassVar[int]
    SLOWEST_CLOCK_FIELD_NUMBER: _ClassVar[int]
    version: int
    chunk: Chunk
    loss_scale: float
    sync: str
    slowest_clock: int
    def __init__(self, version: _Optional[int] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ..., loss_scale: _Optional[float] = ..., sync: _Optional[str] = ..., slowest_clock: _Optional[int] = ...) -> None: ...

class SetSyncRequest(_message.Message):
    __slots__ = ("sync",)
    SYNC_FIELD_NUMBER: _ClassVar[int]
    sync: str
    def __init__(self, sync: _Optional[str] = ...) -> None: ...

class SetSyncResponse(_message.Message):
    __slots__ = ("sync", "version", "sync_switch")
    SYNC_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SYNC_SWITCH_FIELD_NUMBER: _ClassVar[int]
    sync: str
    version: int
    sync_switch: int
    def __init__(self, sync: _Optional[str] = ..., version: _Optional[int] = ..., sync_switch: _Optional[int] = ...) -> None: ...

class PullStateRequest(_message.Message):
    __slots__ = ("names", "chunk_bytes")
    NAMES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    names: _containers.RepeatedScalarFieldContainer[str]
    chunk_bytes: int
    def __init__(self, names: _Optional[_Iterable[str]] = ..., chunk_bytes: _Optional[int] = ...) -> None: ...

class StateChunk(_message.Message):
    __slots__ = ("version", "name", "part_start", "part_stop", "key", "shape", "chunk")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    PART_START_FIELD_NUMBER: _ClassVar[int]
    PART_STOP_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    version: int
    name: str
    part_start: int
    part_stop: int
    key: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    chunk: Chunk
    def __init__(self, version: _Optional[int] = ..., name: _Optional[str] = ..., part_start: _Optional[int] = ..., part_stop: _Optional[int] = ..., key: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ...) -> None: ...

class ExchangeRequest(_message.Message):
    __slots__ = ("tensor", "round", "tag", "from_shard")
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    FROM_SHARD_FIELD_NUMBER: _ClassVar[int]
    tensor: str
    round: int
    tag: str
    from_shard: int
    def __init__(self, tensor: _Optional[str] = ..., round: _Optional[int] = ..., tag: _Optional[str] = ..., from_shard: _Optional[int] = ...) -> None: ...

class ExchangeResponse(_message.Message):
    __slots__ = ("partial",)
    PARTIAL_FIELD_NUMBER: _ClassVar[int]
    partial: Chunk
    def __init__(self, partial: _Optional[_Union[Chunk, _Mapping]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TensorStats(_message.Message):
    __slots__ = ("spec", "weight_bytes", "optimizer_state_bytes")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_STATE_BYTES_FIELD_NUMBER: _ClassVar[int]
    spec: TensorSpec
    weight_bytes: int
    optimizer_state_bytes: int
    def __init__(self, spec: _Optional[_Union[TensorSpec, _Mapping]] = ..., weight_bytes: _Optional[int] = ..., optimizer_state_bytes: _Optional[int] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("shard_index", "num_shards", "version", "sync", "num_workers", "registered_workers", "tensors", "pushes_total", "applied_updates_total", "gradients_applied_total", "push_bytes_total", "pull_bytes_total", "staleness_counts", "worker_clocks", "skipped_steps_total", "loss_scale", "duplicate_pushes_total", "sync_switches_total", "checkpoint_versions", "evicted_workers", "evictions_total", "epoch", "recovering", "waiting_pulls", "role", "backup", "replica_state", "replicated_ops_total", "replication_lag_ops", "left_workers", "leaves_total", "push_received_bytes_total", "row_tables")
    class StalenessCountsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
    class WorkerClocksEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SYNC_FIELD_NUMBER: _ClassVar[int]
    NUM_WORKERS_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_WORKERS_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    PUSHES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    APPLIED_UPDATES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    GRADIENTS_APPLIED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PUSH_BYTES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PULL_BYTES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    STALENESS_COUNTS_FIELD_NUMBER: _ClassVar[int]
    WORKER_CLOCKS_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_STEPS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    LOSS_SCALE_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_PUSHES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    SYNC_SWITCHES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    EVICTED_WORKERS_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    RECOVERING_FIELD_NUMBER: _ClassVar[int]
    WAITING_PULLS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    BACKUP_FIELD_NUMBER: _ClassVar[int]
    REPLICA_STATE_FIELD_NUMBER: _ClassVar[int]
    REPLICATED_OPS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    REPLICATION_LAG_OPS_FIELD_NUMBER: _ClassVar[int]
    LEFT_WORKERS_FIELD_NUMBER: _ClassVar[int]
    LEAVES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PUSH_RECEIVED_BYTES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    ROW_TABLES_FIELD_NUMBER: _ClassVar[int]
    shard_index: int
    num_shards: int
    version: int
    sync: str
    num_workers: int
    registered_workers: _containers.RepeatedScalarFieldContainer[int]
    tensors: _containers.RepeatedCompositeFieldContainer[TensorStats]
    pushes_total: int
    applied_updates_total: int
    gradients_applied_total: int
    push_bytes_total: int
    pull_bytes_total: int
    staleness_counts: _containers.ScalarMap[int, int]
    worker_clocks: _containers.ScalarMap[int, int]
    skipped_steps_total: int
    loss_scale: float
    duplicate_pushes_total: int
    sync_switches_total: int
    checkpoint_versions: _containers.RepeatedScalarFieldContainer[int]
    evicted_workers: _containers.RepeatedScalarFieldContainer[int]
    evictions_total: int
    epoch: int
    recovering: bool
    waiting_pulls: int
    role: str
    backup: str
    replica_state: str
    replicated_ops_total: int
    replication_lag_ops: int
    left_workers: _containers.RepeatedScalarFieldContainer[int]
    leaves_total: int
    push_received_bytes_total: int
    row_tables: _containers.RepeatedCompositeFieldContainer[RowTableStats]
    def __init__(self, shard_index: _Optional[int] = ..., num_shards: _Optional[int] = ..., version: _Optional[int] = ..., sync: _Optional[str] = ..., num_workers: _Optional[int] = ..., registered_workers: _Optional[_Iterable[int]] = ..., tensors: _Optional[_Iterable[_Union[TensorStats, _Mapping]]] = ..., pushes_total: _Optional[int] = ..., applied_updates_total: _Optional[int] = ..., gradients_applied_total: _Optional[int] = ..., push_bytes_total: _Optional[int] = ..., pull_bytes_total: _Optional[int] = ..., staleness_counts: _Optional[_Mapping[int, int]] = ..., worker_clocks: _Optional[_Mapping[int, int]] = ..., skipped_steps_total: _Optional[int] = ..., loss_scale: _Optional[float] = ..., duplicate_pushes_total: _Optional[int] = ..., sync_switches_total: _Optional[int] = ..., checkpoint_versions: _Optional[_Iterable[int]] = ..., evicted_workers: _Optional[_Iterable[int]] = ..., evictions_total: _Optional[int] = ..., epoch: _Optional[int] = ..., recovering: _Optional[bool] = ..., waiting_pulls: _Optional[int] = ..., role: _Optional[str] = ..., backup: _Optional[str] = ..., replica_state: _Optional[str] = ..., replicated_ops_total: _Optional[int] = ..., replication_lag_ops: _Optional[int] = ..., left_workers: _Optional[_Iterable[int]] = ..., leaves_total: _Optional[int] = ..., push_received_bytes_total: _Optional[int] = ..., row_tables: _Optional[_Iterable[_Union[RowTableStats, _Mapping]]] = ...) -> None: ...

class CheckpointRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CheckpointResponse(_message.Message):
    __slots__ = ("version", "path")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    version: int
    path: str
    def __init__(self, version: _Optional[int] = ..., path: _Optional[str] = ...) -> None: ...

class ReplicateRequest(_message.Message):
    __slots__ = ("seq", "op", "args_json", "tensors", "shard_index", "num_shards", "primary", "incarnation", "fence_epoch")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    OP_FIELD_NUMBER: _ClassVar[int]
    ARGS_JSON_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    PRIMARY_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    FENCE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    seq: int
    op: str
    args_json: str
    tensors: bytes
    shard_index: int
    num_shards: int
    primary: str
    incarnation: str
    fence_epoch: int
    def __init__(self, seq: _Optional[int] = ..., op: _Optional[str] = ..., args_json: _Optional[str] = ..., tensors: _Optional[bytes] = ..., shard_index: _Optional[int] = ..., num_shards: _Optional[int] = ..., primary: _Optional[str] = ..., incarnation: _Optional[str] = ..., fence_epoch: _Optional[int] = ...) -> None: ...

class ReplicateResponse(_message.Message):
    __slots__ = ("seq", "version")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    seq: int
    version: int
    def __init__(self, seq: _Optional[int] = ..., version: _Optional[int] = ...) -> None: ...

class PromoteRequest(_message.Message):
    __slots__ = ("reason", "force")
    REASON_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    reason: str
    force: bool
    def __init__(self, reason: _Optional[str] = ..., force: _Optional[bool] = ...) -> None: ...

class PromoteResponse(_message.Message):
    __slots__ = ("shard_index", "version", "epoch", "fence_epoch", "data_port", "data_token", "data_route")
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    FENCE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    DATA_TOKEN_FIELD_NUMBER: _ClassVar[int]
    DATA_ROUTE_FIELD_NUMBER: _ClassVar[int]
    shard_index: int
    version: int
    epoch: int
    fence_epoch: int
    data_port: int
    data_token: bytes
    data_route: int
    def __init__(self, shard_index: _Optional[int] = ..., version: _Optional[int] = ..., epoch: _Optional[int] = ..., fence_epoch: _Optional[int] = ..., data_port: _Optional[int] = ..., data_token: _Optional[bytes] = ..., data_route: _Optional[int] = ...) -> None: ...

class AttachReplicaRequest(_message.Message):
    __slots__ = ("address", "timeout_seconds")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    address: str
    timeout_seconds: float
    def __init__(self, address: _Optional[str] = ..., timeout_seconds: _Optional[float] = ...) -> None: ...

class AttachReplicaResponse(_message.Message):
    __slots__ = ("replica_state",)
    REPLICA_STATE_FIELD_NUMBER: _ClassVar[int]
    replica_state: str
    def __init__(self, replica_state: _Optional[str] = ...) -> None: ...

class TakeOverRequest(_message.Message):
    __slots__ = ("reason", "offer_data", "worker_id")
    REASON_FIELD_NUMBER: _ClassVar[int]
    OFFER_DATA_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    reason: str
    offer_data: bool
    worker_id: int
    def __init__(self, reason: _Optional[str] = ..., offer_data: _Optional[bool] = ..., worker_id: _Optional[int] = ...) -> None: ...

class ConnectRequest(_message.Message):
    __slots__ = ("worker_id",)
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    def __init__(self, worker_id: _Optional[int] = ...) -> None: ...

class ConnectResponse(_message.Message):
    __slots__ = ("data_port", "data_token", "data_route")
    DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    DATA_TOKEN_FIELD_NUMBER: _ClassVar[int]
    DATA_ROUTE_FIELD_NUMBER: _ClassVar[int]
    data_port: int
    data_token: bytes
    data_route: int
    def __init__(self, data_port: _Optional[int] = ..., data_token: _Optional[bytes] = ..., data_route: _Optional[int] = ...) -> None: ...

class RowTableSpec(_message.Message):
    __slots__ = ("name", "dim", "keys", "optimizer", "init_json", "seed", "admit", "expire")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    INIT_JSON_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    ADMIT_FIELD_NUMBER: _ClassVar[int]
    EXPIRE_FIELD_NUMBER: _ClassVar[int]
    name: str
    dim: int
    keys: str
    optimizer: OptimizerSpec
    init_json: str
    seed: int
    admit: int
    expire: int
    def __init__(self, name: _Optional[str] = ..., dim: _Optional[int] = ..., keys: _Optional[str] = ..., optimizer: _Optional[_Union[OptimizerSpec, _Mapping]] = ..., init_json: _Optional[str] = ..., seed: _Optional[int] = ..., admit: _Optional[int] = ..., expire: _Optional[int] = ...) -> None: ...

class RegisterRowsRequest(_message.Message):
    __slots__ = ("table",)
    TABLE_FIELD_NUMBER: _ClassVar[int]
    table: RowTableSpec
    def __init__(self, table: _Optional[_Union[RowTableSpec, _Mapping]] = ...) -> None: ...

class RegisterRowsResponse(_message.Message):
    __slots__ = ("rows", "backup")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    BACKUP_FIELD_NUMBER: _ClassVar[int]
    rows: int
    backup: str
    def __init__(self, rows: _Optional[int] = ..., backup: _Optional[str] = ...) -> None: ...

class PullRowsRequest(_message.Message):
    __slots__ = ("table", "key_dtype", "keys", "dim", "min_round", "min_clock", "epoch")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    KEY_DTYPE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    MIN_ROUND_FIELD_NUMBER: _ClassVar[int]
    MIN_CLOCK_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    table: str
    key_dtype: str
    keys: bytes
    dim: int
    min_round: int
    min_clock: int
    epoch: int
    def __init__(self, table: _Optional[str] = ..., key_dtype: _Optional[str] = ..., keys: _Optional[bytes] = ..., dim: _Optional[int] = ..., min_round: _Optional[int] = ..., min_clock: _Optional[int] = ..., epoch: _Optional[int] = ...) -> None: ...

class PullRowsResponse(_message.Message):
    __slots__ = ("first", "rows", "versions")
    FIRST_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    first: int
    rows: bytes
    versions: bytes
    def __init__(self, first: _Optional[int] = ..., rows: _Optional[bytes] = ..., versions: _Optional[bytes] = ...) -> None: ...

class PushRowsRequest(_message.Message):
    __slots__ = ("table", "key_dtype", "keys", "grads", "dim", "worker_id", "step", "num_workers", "assign", "base_versions", "found_inf", "hold", "hold_index", "epoch", "sync", "min_round")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    KEY_DTYPE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    GRADS_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    NUM_WORKERS_FIELD_NUMBER: _ClassVar[int]
    ASSIGN_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    FOUND_INF_FIELD_NUMBER: _ClassVar[int]
    HOLD_FIELD_NUMBER: _ClassVar[int]
    HOLD_INDEX_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SYNC_FIELD_NUMBER: _ClassVar[int]
    MIN_ROUND_FIELD_NUMBER: _ClassVar[int]
    table: str
    key_dtype: str
    keys: bytes
    grads: bytes
    dim: int
    worker_id: int
    step: int
    num_workers: int
    assign: bool
    base_versions: bytes
    found_inf: bool
    hold: bool
    hold_index: int
    epoch: int
    sync: str
    min_round: int
    def __init__(self, table: _Optional[str] = ..., key_dtype: _Optional[str] = ..., keys: _Optional[bytes] = ..., grads: _Optional[bytes] = ..., dim: _Optional[int] = ..., worker_id: _Optional[int] = ..., step: _Optional[int] = ..., num_workers: _Optional[int] = ..., assign: _Optional[bool] = ..., base_versions: _Optional[bytes] = ..., found_inf: _Optional[bool] = ..., hold: _Optional[bool] = ..., hold_index: _Optional[int] = ..., epoch: _Optional[int] = ..., sync: _Optional[str] = ..., min_round: _Optional[int] = ...) -> None: ...

class PushRowsResponse(_message.Message):
    __slots__ = ("rows", "steps", "skipped", "ready")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    rows: int
    steps: int
    skipped: bool
    ready: int
    def __init__(self, rows: _Optional[int] = ..., steps: _Optional[int] = ..., skipped: _Optional[bool] = ..., ready: _Optional[int] = ...) -> None: ...

class RowTableStats(_message.Message):
    __slots__ = ("spec", "rows", "weight_bytes", "state_bytes", "steps", "admitted", "dropped", "expired", "duplicates", "pending_admission", "skipped", "index_bytes", "staleness_counts")
    class StalenessCountsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
    SPEC_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    STATE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_FIELD_NUMBER: _ClassVar[int]
    DUPLICATES_FIELD_NUMBER: _ClassVar[int]
    PENDING_ADMISSION_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_FIELD_NUMBER: _ClassVar[int]
    INDEX_BYTES_FIELD_NUMBER: _ClassVar[int]
    STALENESS_COUNTS_FIELD_NUMBER: _ClassVar[int]
    spec: RowTableSpec
    rows: int
    weight_bytes: int
    state_bytes: int
    steps: int
    admitted: int
    dropped: int
    expired: int
    duplicates: int
    pending_admission: int
    skipped: int
    index_bytes: int
    staleness_counts: _containers.ScalarMap[int, int]
    def __init__(self, spec: _Optional[_Union[RowTableSpec, _Mapping]] = ..., rows: _Optional[int] = ..., weight_bytes: _Optional[int] = ..., state_bytes: _Optional[int] = ..., steps: _Optional[int] = ..., admitted: _Optional[int] = ..., dropped: _Optional[int] = ..., expired: _Optional[int] = ..., duplicates: _Optional[int] = ..., pending_admission: _Optional[int] = ..., skipped: _Optional[int] = ..., index_bytes: _Optional[int] = ..., staleness_counts: _Optional[_Mapping[int, int]] = ...) -> None: ...
