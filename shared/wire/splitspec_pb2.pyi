from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class HandshakeRequest(_message.Message):
    __slots__ = ("client", "tokenizer_fingerprint", "drafter", "drafter_digest")
    CLIENT_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_DIGEST_FIELD_NUMBER: _ClassVar[int]
    client: str
    tokenizer_fingerprint: str
    drafter: str
    drafter_digest: str
    def __init__(self, client: _Optional[str] = ..., tokenizer_fingerprint: _Optional[str] = ..., drafter: _Optional[str] = ..., drafter_digest: _Optional[str] = ...) -> None: ...

class HandshakeReply(_message.Message):
    __slots__ = ("protocol_version", "model_name", "tokenizer_fingerprint", "vocab_size", "num_layers", "hidden_size", "num_kv_heads", "head_dim", "eos_token_ids", "limits", "device", "dtype", "drafter")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    model_name: str
    tokenizer_fingerprint: str
    vocab_size: int
    num_layers: int
    hidden_size: int
    num_kv_heads: int
    head_dim: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    limits: Limits
    device: str
    dtype: str
    drafter: str
    def __init__(self, protocol_version: _Optional[int] = ..., model_name: _Optional[str] = ..., tokenizer_fingerprint: _Optional[str] = ..., vocab_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., hidden_size: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., limits: _Optional[_Union[Limits, _Mapping]] = ..., device: _Optional[str] = ..., dtype: _Optional[str] = ..., drafter: _Optional[str] = ...) -> None: ...

class Limits(_message.Message):
    __slots__ = ("max_sessions", "max_tree_nodes", "max_context", "max_new_tokens", "session_ttl_s", "max_probe_bytes", "max_inline_payload_bytes", "chained_verify")
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_TREE_NODES_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SESSION_TTL_S_FIELD_NUMBER: _ClassVar[int]
    MAX_PROBE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_INLINE_PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHAINED_VERIFY_FIELD_NUMBER: _ClassVar[int]
    max_sessions: int
    max_tree_nodes: int
    max_context: int
    max_new_tokens: int
    session_ttl_s: float
    max_probe_bytes: int
    max_inline_payload_bytes: int
    chained_verify: bool
    def __init__(self, max_sessions: _Optional[int] = ..., max_tree_nodes: _Optional[int] = ..., max_context: _Optional[int] = ..., max_new_tokens: _Optional[int] = ..., session_ttl_s: _Optional[float] = ..., max_probe_bytes: _Optional[int] = ..., max_inline_payload_bytes: _Optional[int] = ..., chained_verify: _Optional[bool] = ...) -> None: ...

class PayloadSpec(_message.Message):
    __slots__ = ("form", "precision", "tli_layers", "drafter")
    FORM_FIELD_NUMBER: _ClassVar[int]
    PRECISION_FIELD_NUMBER: _ClassVar[int]
    TLI_LAYERS_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    form: str
    precision: str
    tli_layers: int
    drafter: str
    def __init__(self, form: _Optional[str] = ..., precision: _Optional[str] = ..., tli_layers: _Optional[int] = ..., drafter: _Optional[str] = ...) -> None: ...

class Tensor(_message.Message):
    __slots__ = ("name", "data")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    name: str
    data: bytes
    def __init__(self, name: _Optional[str] = ..., data: _Optional[bytes] = ...) -> None: ...

class Payload(_message.Message):
    __slots__ = ("start", "count", "tensors", "pending")
    START_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    start: int
    count: int
    tensors: _containers.RepeatedCompositeFieldContainer[Tensor]
    pending: bool
    def __init__(self, start: _Optional[int] = ..., count: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ..., pending: _Optional[bool] = ...) -> None: ...

class FetchPayloadRequest(_message.Message):
    __slots__ = ("session_id", "start", "end", "spec")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    start: int
    end: int
    spec: PayloadSpec
    def __init__(self, session_id: _Optional[str] = ..., start: _Optional[int] = ..., end: _Optional[int] = ..., spec: _Optional[_Union[PayloadSpec, _Mapping]] = ...) -> None: ...

class Sampling(_message.Message):
    __slots__ = ("temperature", "top_p", "seed", "acceptance", "epsilon", "delta")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_FIELD_NUMBER: _ClassVar[int]
    EPSILON_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    seed: int
    acceptance: str
    epsilon: float
    delta: float
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., acceptance: _Optional[str] = ..., epsilon: _Optional[float] = ..., delta: _Optional[float] = ...) -> None: ...

class OpenSessionRequest(_message.Message):
    __slots__ = ("prompt_ids", "sampling", "payload", "payload_from")
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FROM_FIELD_NUMBER: _ClassVar[int]
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: Sampling
    payload: PayloadSpec
    payload_from: int
    def __init__(self, prompt_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[Sampling, _Mapping]] = ..., payload: _Optional[_Union[PayloadSpec, _Mapping]] = ..., payload_from: _Optional[int] = ...) -> None: ...

class OpenSessionReply(_message.Message):
    __slots__ = ("session_id", "first_token", "length", "compute_s", "payload", "load", "reused_tokens")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    REUSED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    first_token: int
    length: int
    compute_s: float
    payload: Payload
    load: Load
    reused_tokens: int
    def __init__(self, session_id: _Optional[str] = ..., first_token: _Optional[int] = ..., length: _Optional[int] = ..., compute_s: _Optional[float] = ..., payload: _Optional[_Union[Payload, _Mapping]] = ..., load: _Optional[_Union[Load, _Mapping]] = ..., reused_tokens: _Optional[int] = ...) -> None: ...

class Load(_message.Message):
    __slots__ = ("sessions", "step_s", "node_s", "prefer")
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    STEP_S_FIELD_NUMBER: _ClassVar[int]
    NODE_S_FIELD_NUMBER: _ClassVar[int]
    PREFER_FIELD_NUMBER: _ClassVar[int]
    sessions: int
    step_s: float
    node_s: float
    prefer: str
    def __init__(self, sessions: _Optional[int] = ..., step_s: _Optional[float] = ..., node_s: _Optional[float] = ..., prefer: _Optional[str] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("session_id", "tokens", "parents", "length", "payload", "assumed")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    ASSUMED_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    tokens: _containers.RepeatedScalarFieldContainer[int]
    parents: _containers.RepeatedScalarFieldContainer[int]
    length: int
    payload: PayloadSpec
    assumed: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, session_id: _Optional[str] = ..., tokens: _Optional[_Iterable[int]] = ..., parents: _Optional[_Iterable[int]] = ..., length: _Optional[int] = ..., payload: _Optional[_Union[PayloadSpec, _Mapping]] = ..., assumed: _Optional[_Iterable[int]] = ...) -> None: ...

class VerifyReply(_message.Message):
    __slots__ = ("accepted", "bonus_token", "length", "compute_s", "payload", "verified", "load", "stale")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    BONUS_TOKEN_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    VERIFIED_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    STALE_FIELD_NUMBER: _ClassVar[int]
    accepted: _containers.RepeatedScalarFieldContainer[int]
    bonus_token: int
    length: int
    compute_s: float
    payload: Payload
    verified: int
    load: Load
    stale: bool
    def __init__(self, accepted: _Optional[_Iterable[int]] = ..., bonus_token: _Optional[int] = ..., length: _Optional[int] = ..., compute_s: _Optional[float] = ..., payload: _Optional[_Union[Payload, _Mapping]] = ..., verified: _Optional[int] = ..., load: _Optional[_Union[Load, _Mapping]] = ..., stale: _Optional[bool] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("session_id", "length", "max_new_tokens", "stop_token_ids", "payload", "payload_every", "prompt_ids", "sampling", "self_draft", "payload_from")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_EVERY_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SELF_DRAFT_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FROM_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    length: int
    max_new_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    payload: PayloadSpec
    payload_every: int
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: Sampling
    self_draft: int
    payload_from: int
    def __init__(self, session_id: _Optional[str] = ..., length: _Optional[int] = ..., max_new_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., payload: _Optional[_Union[PayloadSpec, _Mapping]] = ..., payload_every: _Optional[int] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[Sampling, _Mapping]] = ..., self_draft: _Optional[int] = ..., payload_from: _Optional[int] = ...) -> None: ...

class DecodeChunk(_message.Message):
    __slots__ = ("token", "length", "compute_s", "payload", "finish_reason", "load", "session_id", "reused_tokens")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    REUSED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    token: int
    length: int
    compute_s: float
    payload: Payload
    finish_reason: str
    load: Load
    session_id: str
    reused_tokens: int
    def __init__(self, token: _Optional[int] = ..., length: _Optional[int] = ..., compute_s: _Optional[float] = ..., payload: _Optional[_Union[Payload, _Mapping]] = ..., finish_reason: _Optional[str] = ..., load: _Optional[_Union[Load, _Mapping]] = ..., session_id: _Optional[str] = ..., reused_tokens: _Optional[int] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class CloseSessionReply(_message.Message):
    __slots__ = ("length",)
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    length: int
    def __init__(self, length: _Optional[int] = ...) -> None: ...

class CompleteRequest(_message.Message):
    __slots__ = ("prompt_ids", "sampling", "max_new_tokens", "stop_token_ids")
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: Sampling
    max_new_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, prompt_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[Sampling, _Mapping]] = ..., max_new_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class CompleteChunk(_message.Message):
    __slots__ = ("tokens", "compute_s", "finish_reason", "reused_tokens")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    REUSED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    compute_s: float
    finish_reason: str
    reused_tokens: int
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., compute_s: _Optional[float] = ..., finish_reason: _Optional[str] = ..., reused_tokens: _Optional[int] = ...) -> None: ...

class ProbeRequest(_message.Message):
    __slots__ = ("payload", "reply_bytes")
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    REPLY_BYTES_FIELD_NUMBER: _ClassVar[int]
    payload: bytes
    reply_bytes: int
    def __init__(self, payload: _Optional[bytes] = ..., reply_bytes: _Optional[int] = ...) -> None: ...

class ProbeReply(_message.Message):
    __slots__ = ("payload", "compute_s")
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    payload: bytes
    compute_s: float
    def __init__(self, payload: _Optional[bytes] = ..., compute_s: _Optional[float] = ...) -> None: ...
