"""The tcp transport's bytes on the wire: frames, the handshake, and their pure codecs.

Words used here and in ``tcp.py`` and ``tcp_setup.py``:

- *frame*: what one rank writes to one peer for one message. A fixed 52-byte *frame header*
  (magic ``RTF1``, version, frame kind, 2 reserved zero bytes, the CallHeader (36 bytes), the
  payload length as u64 little endian) followed by exactly ``length`` payload bytes. The
  frame header is decoded and checked before a single payload byte is read; nothing is ever
  allocated from the length a frame claims.
- *DATA frame*: the payload is a message's raw bytes (a numpy buffer's memory, no pickle).
- *ABORT frame*: the sender failed; the payload is a u32 error code (errors.ERROR_CODES)
  and a UTF-8 message of at most MAX_ABORT_TEXT bytes. The receiver raises the same error
  type, "rank X aborted: ...".
- *hello*: the fixed 68-byte first message of each side of a new connection: magic
  ``RTHS``, version, role (connect/accept), flags (bit 0: this side holds a secret), the
  sender's rank, the rank it believes it is talking to, world size, a 16-byte digest of the
  job prefix, and a fresh 32-byte random *nonce*.
- *handshake*: connector sends its hello; the acceptor answers with its hello and a MAC;
  the connector checks that MAC and sends its own; the acceptor checks it and answers
  ``RTOK``. Each MAC is HMAC-SHA256 keyed with the job's shared secret over a role label and
  both hellos (so over both nonces): a recorded handshake replayed against a fresh nonce
  does not verify. Without a secret the MACs are zeros, but the magic, version, ranks,
  world size and job digest are still checked, so a stray connection or a peer of another
  job is refused with ProtocolError.

The secret is only ever an argument of ``hmac``; it never appears in a message or a log.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import struct
from dataclasses import dataclass
from typing import Optional

from ..errors import ERROR_TYPES, AuthError, CommError, ProtocolError, abort_payload
from .base import CallHeader

VERSION = 1

# --- frames ----------------------------------------------------------------------------------

FRAME_MAGIC = b"RTF1"
DATA = 1
ABORT = 2
FRAME_KINDS = (DATA, ABORT)

_FRAME = struct.Struct(f"<4sBBH{CallHeader.SIZE}sQ")
FRAME_HEADER_SIZE = _FRAME.size  # 52 with the 36-byte CallHeader

#: The largest payload any frame may announce (1 TiB); larger is malformed, not a mismatch.
MAX_PAYLOAD = 1 << 40
#: The largest ABORT message text, in bytes.
MAX_ABORT_TEXT = 1024
_ABORT_CODE = struct.Struct("<I")

_ZERO_CALL = bytes(CallHeader.SIZE)


@dataclass(frozen=True, slots=True)
class FrameHeader:
    """A decoded, checked frame header. ``call`` is None for ABORT frames."""

    kind: int
    call: Optional[CallHeader]
    length: int


def encode_data_header(call: CallHeader, length: int) -> bytes:
    """The FRAME_HEADER_SIZE bytes that precede a DATA frame's ``length`` payload bytes."""
    if not 0 <= length <= MAX_PAYLOAD:
        raise ValueError(f"payload length must be in [0, {MAX_PAYLOAD}], got {length}")
    return _FRAME.pack(FRAME_MAGIC, VERSION, DATA, 0, call.pack(), length)


def encode_abort(error: BaseException) -> bytes:
    """A whole ABORT frame (header and payload) carrying ``error``'s type and text."""
    code, raw = abort_payload(error, MAX_ABORT_TEXT)
    payload = _ABORT_CODE.pack(code) + raw
    return _FRAME.pack(FRAME_MAGIC, VERSION, ABORT, 0, _ZERO_CALL, len(payload)) + payload


def decode_frame_header(data: bytes | bytearray | memoryview) -> FrameHeader:
    """Check and decode a frame header; ProtocolError for anything that is not one."""
    if len(data) != FRAME_HEADER_SIZE:
        raise ProtocolError(f"frame header must be {FRAME_HEADER_SIZE} bytes, got {len(data)}")
    magic, version, kind, reserved, call, length = _FRAME.unpack(data)
    if magic != FRAME_MAGIC:
        raise ProtocolError(f"bad frame magic {bytes(magic)!r} (expected {FRAME_MAGIC!r})")
    if version != VERSION:
        raise ProtocolError(f"unsupported frame version {version} (this side speaks {VERSION})")
    if reserved != 0:
        raise ProtocolError(f"frame reserved field is {reserved}, must be 0")
    if kind == DATA:
        if length > MAX_PAYLOAD:
            raise ProtocolError(f"frame claims {length} payload bytes, more than the limit {MAX_PAYLOAD}")
        return FrameHeader(DATA, CallHeader.unpack(call), length)
    if kind == ABORT:
        if not _ABORT_CODE.size <= length <= _ABORT_CODE.size + MAX_ABORT_TEXT:
            raise ProtocolError(f"ABORT frame claims {length} payload bytes, outside [4, {4 + MAX_ABORT_TEXT}]")
        if call != _ZERO_CALL:
            raise ProtocolError("ABORT frame carries a non-zero call header")
        return FrameHeader(ABORT, None, length)
    raise ProtocolError(f"unknown frame kind {kind}")


def abort_error(payload: bytes | bytearray | memoryview, peer: int) -> CommError:
    """The exception an ABORT payload from ``peer`` stands for (ProtocolError if garbled)."""
    if len(payload) < _ABORT_CODE.size:
        return ProtocolError(f"rank {peer} sent a truncated ABORT frame")
    (code,) = _ABORT_CODE.unpack_from(payload)
    text = bytes(payload[_ABORT_CODE.size :]).decode("utf-8", "replace")
    kind = ERROR_TYPES.get(code, CommError)
    return kind(f"rank {peer} aborted: {text}")


# --- handshake -------------------------------------------------------------------------------

HELLO_MAGIC = b"RTHS"
CONNECT = 1
ACCEPT = 2
FLAG_SECRET = 1

_HELLO = struct.Struct("<4sBBHIII16s32s")
HELLO_SIZE = _HELLO.size  # 68
MAC_SIZE = 32
NONCE_SIZE = 32
ACK = b"RTOK"
_ZERO_MAC = bytes(MAC_SIZE)
_MAX_RANKS = 1 << 20


def job_digest(prefix: str) -> bytes:
    """16 bytes that tell this job's peers from another job's."""
    return hashlib.sha256(b"ringtrain-job\0" + prefix.encode("utf-8")).digest()[:16]


@dataclass(frozen=True, slots=True)
class Hello:
    role: int
    has_secret: bool
    rank: int
    peer: int  # the rank the sender believes is at the other end
    world_size: int
    job: bytes
    nonce: bytes

    def __post_init__(self) -> None:
        if self.role not in (CONNECT, ACCEPT):
            raise ValueError(f"role must be CONNECT or ACCEPT, got {self.role}")
        if len(self.job) != 16 or len(self.nonce) != NONCE_SIZE:
            raise ValueError("job digest must be 16 bytes and nonce 32 bytes")

    @classmethod
    def fresh(cls, role: int, has_secret: bool, rank: int, peer: int, world_size: int, job: bytes) -> "Hello":
        return cls(role, has_secret, rank, peer, world_size, job, secrets.token_bytes(NONCE_SIZE))

    def pack(self) -> bytes:
        flags = FLAG_SECRET if self.has_secret else 0
        return _HELLO.pack(
            HELLO_MAGIC, VERSION, self.role, flags, self.rank, self.peer, self.world_size, self.job, self.nonce
        )

    @classmethod
    def unpack(cls, data: bytes | bytearray | memoryview) -> "Hello":
        if len(data) != HELLO_SIZE:
            raise ProtocolError(f"hello must be {HELLO_SIZE} bytes, got {len(data)}")
        magic, version, role, flags, rank, peer, world, job, nonce = _HELLO.unpack(data)
        if magic != HELLO_MAGIC:
            raise ProtocolError(f"not a ringtrain peer: bad handshake magic {bytes(magic)!r}")
        if version != VERSION:
            raise ProtocolError(f"peer speaks handshake version {version}, this side speaks {VERSION}")
        if role not in (CONNECT, ACCEPT) or flags & ~FLAG_SECRET:
            raise ProtocolError(f"malformed hello: role {role}, flags {flags:#x}")
        if not (0 < world <= _MAX_RANKS and rank < world and peer < world):
            raise ProtocolError(f"malformed hello: rank {rank}, peer {peer}, world size {world}")
        return cls(role, bool(flags & FLAG_SECRET), rank, peer, world, bytes(job), bytes(nonce))


def check_hello(theirs: Hello, mine: Hello) -> None:
    """ProtocolError unless ``theirs`` is the hello of this job's peer ``mine.peer``."""
    if theirs.role == mine.role:
        raise ProtocolError(f"both sides claim handshake role {mine.role}")
    if theirs.job != mine.job:
        raise ProtocolError(f"rank {theirs.rank} belongs to another job (different job prefix)")
    if theirs.world_size != mine.world_size:
        raise ProtocolError(
            f"rank {theirs.rank} says world size {theirs.world_size}, this rank {mine.rank} has {mine.world_size}"
        )
    if theirs.peer != mine.rank:
        raise ProtocolError(f"rank {theirs.rank} wanted rank {theirs.peer} but reached rank {mine.rank}")
    if mine.role == CONNECT and theirs.rank != mine.peer:
        raise ProtocolError(f"rank {mine.rank} wanted rank {mine.peer} but reached rank {theirs.rank}")


def check_secrets_agree(theirs: Hello, has_secret: bool, them: Optional[str] = None) -> None:
    """AuthError when exactly one side holds a secret. ``them``: what the message calls the peer
    (default ``rank {theirs.rank}``)."""
    them = f"rank {theirs.rank}" if them is None else them
    if theirs.has_secret and not has_secret:
        raise AuthError(f"{them} requires the job's shared secret and this rank has none")
    if has_secret and not theirs.has_secret:
        raise AuthError(f"{them} holds no shared secret; refusing an unauthenticated peer")


def handshake_mac(secret: Optional[bytes], role: int, connect_hello: bytes, accept_hello: bytes) -> bytes:
    """The MAC the side playing ``role`` sends: HMAC-SHA256 over a role label and both hellos."""
    if secret is None:
        return _ZERO_MAC
    label = b"ringtrain-connect\0" if role == CONNECT else b"ringtrain-accept\0"
    return hmac.new(secret, label + connect_hello + accept_hello, hashlib.sha256).digest()


def mac_ok(expected: bytes, got: bytes | bytearray | memoryview) -> bool:
    return hmac.compare_digest(expected, bytes(got))
