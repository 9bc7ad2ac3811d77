from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class Sampling(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed", "logprobs")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    logprobs: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., logprobs: _Optional[int] = ...) -> None: ...

class Entry(_message.Message):
    __slots__ = ("seq_id", "start_pos", "n_tokens", "sample", "blocks")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    START_POS_FIELD_NUMBER: _ClassVar[int]
    N_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    start_pos: int
    n_tokens: int
    sample: Sampling
    blocks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_id: _Optional[int] = ..., start_pos: _Optional[int] = ..., n_tokens: _Optional[int] = ..., sample: _Optional[_Union[Sampling, _Mapping]] = ..., blocks: _Optional[_Iterable[int]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ForwardRequest(_message.Message):
    __slots__ = ("entries", "token_ids", "hidden", "wave_id", "relay_to", "steps", "reply_steps")
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    WAVE_ID_FIELD_NUMBER: _ClassVar[int]
    RELAY_TO_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    REPLY_STEPS_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[Entry]
    token_ids: TokenIds
    hidden: Tensor
    wave_id: int
    relay_to: _containers.RepeatedScalarFieldContainer[str]
    steps: int
    reply_steps: int
    def __init__(self, entries: _Optional[_Iterable[_Union[Entry, _Mapping]]] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., hidden: _Optional[_Union[Tensor, _Mapping]] = ..., wave_id: _Optional[int] = ..., relay_to: _Optional[_Iterable[str]] = ..., steps: _Optional[int] = ..., reply_steps: _Optional[int] = ...) -> None: ...

class EndStepsRequest(_message.Message):
    __slots__ = ("wave_id",)
    WAVE_ID_FIELD_NUMBER: _ClassVar[int]
    wave_id: int
    def __init__(self, wave_id: _Optional[int] = ...) -> None: ...

class EndStepsReply(_message.Message):
    __slots__ = ("running",)
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    running: bool
    def __init__(self, running: _Optional[bool] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class Sample(_message.Message):
    __slots__ = ("present", "token_id", "logprob", "top")
    PRESENT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    present: bool
    token_id: int
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, present: _Optional[bool] = ..., token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class Samples(_message.Message):
    __slots__ = ("samples",)
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    samples: _containers.RepeatedCompositeFieldContainer[Sample]
    def __init__(self, samples: _Optional[_Iterable[_Union[Sample, _Mapping]]] = ...) -> None: ...

class KVUsage(_message.Message):
    __slots__ = ("bytes_used", "blocks_used", "sequences", "changes")
    BYTES_USED_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    CHANGES_FIELD_NUMBER: _ClassVar[int]
    bytes_used: int
    blocks_used: int
    sequences: int
    changes: int
    def __init__(self, bytes_used: _Optional[int] = ..., blocks_used: _Optional[int] = ..., sequences: _Optional[int] = ..., changes: _Optional[int] = ...) -> None: ...

class ForwardReply(_message.Message):
    __slots__ = ("hidden", "samples", "forward_seconds", "kv", "relayed", "served_seconds")
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    FORWARD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    RELAYED_FIELD_NUMBER: _ClassVar[int]
    SERVED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    hidden: Tensor
    samples: Samples
    forward_seconds: float
    kv: KVUsage
    relayed: _containers.RepeatedCompositeFieldContainer[RelayHop]
    served_seconds: float
    def __init__(self, hidden: _Optional[_Union[Tensor, _Mapping]] = ..., samples: _Optional[_Union[Samples, _Mapping]] = ..., forward_seconds: _Optional[float] = ..., kv: _Optional[_Union[KVUsage, _Mapping]] = ..., relayed: _Optional[_Iterable[_Union[RelayHop, _Mapping]]] = ..., served_seconds: _Optional[float] = ...) -> None: ...

class RelayHop(_message.Message):
    __slots__ = ("address", "kv", "forward_seconds", "served_seconds", "call_seconds")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    FORWARD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SERVED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CALL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    address: str
    kv: KVUsage
    forward_seconds: float
    served_seconds: float
    call_seconds: float
    def __init__(self, address: _Optional[str] = ..., kv: _Optional[_Union[KVUsage, _Mapping]] = ..., forward_seconds: _Optional[float] = ..., served_seconds: _Optional[float] = ..., call_seconds: _Optional[float] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("seq_ids", "queue_if_busy")
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_IF_BUSY_FIELD_NUMBER: _ClassVar[int]
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    queue_if_busy: bool
    def __init__(self, seq_ids: _Optional[_Iterable[int]] = ..., queue_if_busy: _Optional[bool] = ...) -> None: ...

class ReleaseReply(_message.Message):
    __slots__ = ("released", "kv", "queued")
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    released: int
    kv: KVUsage
    queued: bool
    def __init__(self, released: _Optional[int] = ..., kv: _Optional[_Union[KVUsage, _Mapping]] = ..., queued: _Optional[bool] = ...) -> None: ...

class ExportKVRequest(_message.Message):
    __slots__ = ("entries", "layer_start", "layer_end")
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[Entry]
    layer_start: int
    layer_end: int
    def __init__(self, entries: _Optional[_Iterable[_Union[Entry, _Mapping]]] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ...) -> None: ...

class ExportKVReply(_message.Message):
    __slots__ = ("k", "v", "kv")
    K_FIELD_NUMBER: _ClassVar[int]
    V_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    k: Tensor
    v: Tensor
    kv: KVUsage
    def __init__(self, k: _Optional[_Union[Tensor, _Mapping]] = ..., v: _Optional[_Union[Tensor, _Mapping]] = ..., kv: _Optional[_Union[KVUsage, _Mapping]] = ...) -> None: ...

class ImportKVRequest(_message.Message):
    __slots__ = ("entries", "k", "v")
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    V_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[Entry]
    k: Tensor
    v: Tensor
    def __init__(self, entries: _Optional[_Iterable[_Union[Entry, _Mapping]]] = ..., k: _Optional[_Union[Tensor, _Mapping]] = ..., v: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class ImportKVReply(_message.Message):
    __slots__ = ("kv",)
    KV_FIELD_NUMBER: _ClassVar[int]
    kv: KVUsage
    def __init__(self, kv: _Optional[_Union[KVUsage, _Mapping]] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoReply(_message.Message):
    __slots__ = ("model", "layer_start", "layer_end", "num_layers", "device", "dtype", "kv_bytes_used", "kv_bytes_total", "sequences", "block_tokens", "kv_blocks_total", "kv_blocks_used", "hidden_size", "vocab_size", "metrics_address", "prefill_chunk_invariant", "kv_heads", "head_dim", "relay_port")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_USED_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    METRICS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_CHUNK_INVARIANT_FIELD_NUMBER: _ClassVar[int]
    KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    RELAY_PORT_FIELD_NUMBER: _ClassVar[int]
    model: str
    layer_start: int
    layer_end: int
    num_layers: int
    device: str
    dtype: str
    kv_bytes_used: int
    kv_bytes_total: int
    sequences: int
    block_tokens: int
    kv_blocks_total: int
    kv_blocks_used: int
    hidden_size: int
    vocab_size: int
    metrics_address: str
    prefill_chunk_invariant: bool
    kv_heads: int
    head_dim: int
    relay_port: int
    def __init__(self, model: _Optional[str] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., num_layers: _Optional[int] = ..., device: _Optional[str] = ..., dtype: _Optional[str] = ..., kv_bytes_used: _Optional[int] = ..., kv_bytes_total: _Optional[int] = ..., sequences: _Optional[int] = ..., block_tokens: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., kv_blocks_used: _Optional[int] = ..., hidden_size: _Optional[int] = ..., vocab_size: _Optional[int] = ..., metrics_address: _Optional[str] = ..., prefill_chunk_invariant: _Optional[bool] = ..., kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., relay_port: _Optional[int] = ...) -> None: ...
