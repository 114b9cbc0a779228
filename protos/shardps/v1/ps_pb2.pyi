from collections.abc import Iterable as _Iterable
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar

from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    FLOAT32: _ClassVar[DType]
    FLOAT16: _ClassVar[DType]
    BFLOAT16: _ClassVar[DType]
DTYPE_UNSPECIFIED: DType
FLOAT32: DType
FLOAT16: DType
BFLOAT16: DType

class OptimizerSpec(_message.Message):
    __slots__ = ("name", "params_json")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PARAMS_JSON_FIELD_NUMBER: _ClassVar[int]
    name: str
    params_json: str
    def __init__(self, name: str | None = ..., params_json: str | None = ...) -> None: ...

class Part(_message.Message):
    __slots__ = ("start", "stop")
    START_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    start: int
    stop: int
    def __init__(self, start: int | None = ..., stop: int | None = ...) -> None: ...

class TensorSpec(_message.Message):
    __slots__ = ("name", "shape", "dtype", "optimizer", "parts")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: DType
    optimizer: OptimizerSpec
    parts: _containers.RepeatedCompositeFieldContainer[Part]
    def __init__(self, name: str | None = ..., shape: _Iterable[int] | None = ..., dtype: DType | str | None = ..., optimizer: OptimizerSpec | _Mapping | None = ..., parts: _Iterable[Part | _Mapping] | None = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("name", "offset", "dtype", "data", "shape")
    NAME_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    offset: int
    dtype: DType
    data: bytes
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: str | None = ..., offset: int | None = ..., dtype: DType | str | None = ..., data: bytes | None = ..., shape: _Iterable[int] | None = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("worker_id", "num_workers", "sync", "tensors", "chunk", "provides_values")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_WORKERS_FIELD_NUMBER: _ClassVar[int]
    SYNC_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    PROVIDES_VALUES_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    num_workers: int
    sync: str
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    chunk: Chunk
    provides_values: bool
    def __init__(self, worker_id: int | None = ..., num_workers: int | None = ..., sync: str | None = ..., tensors: _Iterable[TensorSpec | _Mapping] | None = ..., chunk: Chunk | _Mapping | None = ..., provides_values: bool | None = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("version", "shard_index", "num_shards", "sync", "created")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    SYNC_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    version: int
    shard_index: int
    num_shards: int
    sync: str
    created: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, version: int | None = ..., shard_index: int | None = ..., num_shards: int | None = ..., sync: str | None = ..., created: _Iterable[str] | None = ...) -> None: ...

class PushRequest(_message.Message):
    __slots__ = ("worker_id", "step", "base_version", "chunk")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    step: int
    base_version: int
    chunk: Chunk
    def __init__(self, worker_id: int | None = ..., step: int | None = ..., base_version: int | None = ..., chunk: Chunk | _Mapping | None = ...) -> None: ...

class PushResponse(_message.Message):
    __slots__ = ("version", "applied", "duplicate", "sync")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    SYNC_FIELD_NUMBER: _ClassVar[int]
    version: int
    applied: bool
    duplicate: bool
    sync: str
    def __init__(self, version: int | None = ..., applied: bool | None = ..., duplicate: bool | None = ..., sync: str | None = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("worker_id", "names", "min_version", "dtype", "chunk_bytes")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    NAMES_FIELD_NUMBER: _ClassVar[int]
    MIN_VERSION_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    names: _containers.RepeatedScalarFieldContainer[str]
    min_version: int
    dtype: DType
    chunk_bytes: int
    def __init__(self, worker_id: int | None = ..., names: _Iterable[str] | None = ..., min_version: int | None = ..., dtype: DType | str | None = ..., chunk_bytes: int | None = ...) -> None: ...

class PullResponse(_message.Message):
    __slots__ = ("version", "chunk")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    version: int
    chunk: Chunk
    def __init__(self, version: int | None = ..., chunk: Chunk | _Mapping | None = ...) -> None: ...

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
    def __init__(self, spec: TensorSpec | _Mapping | None = ..., weight_bytes: int | None = ..., optimizer_state_bytes: int | None = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("shard_index", "num_shards", "version", "sync", "num_workers", "registered_workers", "tensors", "pushes_total", "applied_updates_total", "gradients_applied_total", "push_bytes_total", "pull_bytes_total", "staleness_counts", "worker_clocks")
    class StalenessCountsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: int | None = ..., value: int | None = ...) -> None: ...
    class WorkerClocksEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: int | None = ..., value: int | None = ...) -> None: ...
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
    def __init__(self, shard_index: int | None = ..., num_shards: int | None = ..., version: int | None = ..., sync: str | None = ..., num_workers: int | None = ..., registered_workers: _Iterable[int] | None = ..., tensors: _Iterable[TensorStats | _Mapping] | None = ..., pushes_total: int | None = ..., applied_updates_total: int | None = ..., gradients_applied_total: int | None = ..., push_bytes_total: int | None = ..., pull_bytes_total: int | None = ..., staleness_counts: _Mapping[int, int] | None = ..., worker_clocks: _Mapping[int, int] | None = ...) -> None: ...
