from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class RegisterExpertRequest(_message.Message):
    __slots__ = ("table", "program")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    PROGRAM_FIELD_NUMBER: _ClassVar[int]
    table: str
    program: bytes
    def __init__(self, table: _Optional[str] = ..., program: _Optional[bytes] = ...) -> None: ...

class RegisterExpertResponse(_message.Message):
    __slots__ = ("parameters",)
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    parameters: int
    def __init__(self, parameters: _Optional[int] = ...) -> None: ...

class ExpertCall(_message.Message):
    __slots__ = ("table", "dim", "d_model", "experts", "counts", "tokens", "grad_out", "worker_id", "step", "num_workers", "hold", "hold_index", "epoch", "min_round", "min_clock", "sync")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    D_MODEL_FIELD_NUMBER: _ClassVar[int]
    EXPERTS_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    GRAD_OUT_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    NUM_WORKERS_FIELD_NUMBER: _ClassVar[int]
    HOLD_FIELD_NUMBER: _ClassVar[int]
    HOLD_INDEX_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    MIN_ROUND_FIELD_NUMBER: _ClassVar[int]
    MIN_CLOCK_FIELD_NUMBER: _ClassVar[int]
    SYNC_FIELD_NUMBER: _ClassVar[int]
    table: str
    dim: int
    d_model: int
    experts: bytes
    counts: bytes
    tokens: bytes
    grad_out: bytes
    worker_id: int
    step: int
    num_workers: int
    hold: bool
    hold_index: int
    epoch: int
    min_round: int
    min_clock: int
    sync: str
    def __init__(self, table: _Optional[str] = ..., dim: _Optional[int] = ..., d_model: _Optional[int] = ..., experts: _Optional[bytes] = ..., counts: _Optional[bytes] = ..., tokens: _Optional[bytes] = ..., grad_out: _Optional[bytes] = ..., worker_id: _Optional[int] = ..., step: _Optional[int] = ..., num_workers: _Optional[int] = ..., hold: _Optional[bool] = ..., hold_index: _Optional[int] = ..., epoch: _Optional[int] = ..., min_round: _Optional[int] = ..., min_clock: _Optional[int] = ..., sync: _Optional[str] = ...) -> None: ...

class ExpertAnswer(_message.Message):
    __slots__ = ("out", "rows", "ready")
    OUT_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    out: bytes
    rows: int
    ready: int
    def __init__(self, out: _Optional[bytes] = ..., rows: _Optional[int] = ..., ready: _Optional[int] = ...) -> None: ...
