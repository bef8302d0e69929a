"""The tcp transport's wire format: frame and hello codecs, MACs; pure, no sockets."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ringtrain.errors import (
    ERROR_CODES,
    AuthError,
    CommError,
    CommTimeout,
    MismatchError,
    PeerLost,
    ProtocolError,
)
from ringtrain.transport import wire
from ringtrain.transport.base import ALGORITHMS, DTYPES, KINDS, OPS, CallHeader

pytestmark = pytest.mark.timeout(60)

CALL = CallHeader(7, "allreduce", "sum", "ring", "float32", 1000, 12345, -1)


def data_header(call=CALL, length=4000, *, magic=wire.FRAME_MAGIC, version=wire.VERSION, kind=wire.DATA, reserved=0):
    return struct.pack(f"<4sBBH{CallHeader.SIZE}sQ", magic, version, kind, reserved, call.pack(), length)


calls = st.builds(
    CallHeader,
    seq=st.integers(0, 2**64 - 1),
    kind=st.sampled_from(KINDS),
    op=st.sampled_from(OPS),
    algorithm=st.sampled_from(ALGORITHMS),
    dtype=st.sampled_from(DTYPES),
    numel=st.integers(0, 2**62),
    shape=st.integers(0, 2**32 - 1),
    root=st.integers(-1, 2**31 - 1),
)


@settings(max_examples=300, deadline=None)
@given(calls, st.integers(0, wire.MAX_PAYLOAD))
def test_data_header_round_trip(call, length):
    raw = wire.encode_data_header(call, length)
    assert len(raw) == wire.FRAME_HEADER_SIZE
    fh = wire.decode_frame_header(raw)
    assert fh == wire.FrameHeader(wire.DATA, call, length)


@pytest.mark.parametrize(
    "error, kind",
    [
        (CommTimeout("slow"), CommTimeout),
        (PeerLost("gone"), PeerLost),
        (MismatchError("differs"), MismatchError),
        (AuthError("who"), AuthError),
        (ProtocolError("bytes"), ProtocolError),
        (CommError("plain"), CommError),
        (ValueError("user code failed"), CommError),
    ],
)
def test_abort_round_trip_keeps_type_and_text(error, kind):
    frame = wire.encode_abort(error)
    fh = wire.decode_frame_header(frame[: wire.FRAME_HEADER_SIZE])
    assert fh.kind == wire.ABORT and fh.call is None
    payload = frame[wire.FRAME_HEADER_SIZE :]
    assert len(payload) == fh.length
    got = wire.abort_error(payload, peer=3)
    assert type(got) is kind
    assert str(got).startswith("rank 3 aborted: ")
    assert str(error) in str(got)


def test_abort_text_is_bounded_and_valid_utf8():
    # "a" first, so that MAX_ABORT_TEXT (even) bytes end in the middle of a 2-byte "é": with "é"
    # alone the cut fell on a character boundary and the re-trim was never exercised.
    frame = wire.encode_abort(CommError("a" + "é" * 5000))
    fh = wire.decode_frame_header(frame[: wire.FRAME_HEADER_SIZE])
    assert fh.length == 4 + wire.MAX_ABORT_TEXT - 1  # the half character dropped
    raw = frame[wire.FRAME_HEADER_SIZE + 4 :]
    assert raw.decode("utf-8") == "a" + "é" * ((wire.MAX_ABORT_TEXT - 2) // 2)  # strict: no half character
    text = str(wire.abort_error(frame[wire.FRAME_HEADER_SIZE :], 0))
    assert text.endswith("é") and "\ufffd" not in text


def test_abort_length_limits_are_exact():
    def abort_header(length):
        return struct.pack(f"<4sBBH{CallHeader.SIZE}sQ", wire.FRAME_MAGIC, wire.VERSION, wire.ABORT, 0,
                           bytes(CallHeader.SIZE), length)

    for length in (4, 4 + wire.MAX_ABORT_TEXT):
        assert wire.decode_frame_header(abort_header(length)) == wire.FrameHeader(wire.ABORT, None, length)
    for length in (3, 4 + wire.MAX_ABORT_TEXT + 1):
        with pytest.raises(ProtocolError, match="ABORT frame claims"):
            wire.decode_frame_header(abort_header(length))
    # The shortest ABORT the decoder takes (a code, no text) stands for its error type, not for
    # a truncated frame.
    got = wire.abort_error(struct.pack("<I", ERROR_CODES[CommTimeout]), 5)
    assert type(got) is CommTimeout and str(got) == "rank 5 aborted: "


@pytest.mark.parametrize(
    "raw, words",
    [
        (data_header(magic=b"HTTP"), "magic"),
        (data_header(version=9), "version"),
        (data_header(kind=7), "kind"),
        (data_header(reserved=1), "reserved"),
        (data_header(length=wire.MAX_PAYLOAD + 1), "limit"),
        (data_header(length=2**64 - 1), "limit"),
        (data_header()[:-1], "bytes"),
        (b"", "bytes"),
        (data_header(kind=wire.ABORT, length=10), "call header"),
        (data_header(CallHeader(0, "allreduce"), kind=wire.ABORT, length=10**9), "ABORT"),
        ((b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + bytes(64))[: wire.FRAME_HEADER_SIZE], "magic"),
    ],
)
def test_malformed_frame_headers(raw, words):
    with pytest.raises(ProtocolError, match=words):
        wire.decode_frame_header(raw)


def test_unknown_call_codes_are_a_protocol_error():
    raw = bytearray(data_header())
    raw[8 + 8] = 200  # the CallHeader's kind byte
    with pytest.raises(ProtocolError, match="unknown codes"):
        wire.decode_frame_header(bytes(raw))


@settings(max_examples=1000, deadline=None)
@given(st.binary(min_size=wire.FRAME_HEADER_SIZE, max_size=wire.FRAME_HEADER_SIZE))
def test_fuzz_frame_header_decoder(raw):
    """Any 52 bytes decode to a checked header or raise ProtocolError, nothing else."""
    try:
        fh = wire.decode_frame_header(raw)
    except ProtocolError:
        return
    assert fh.length <= wire.MAX_PAYLOAD


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=wire.FRAME_HEADER_SIZE), st.binary(min_size=0, max_size=8), st.integers(0, 50))
def test_fuzz_frame_header_decoder_from_valid_magic(tail, noise, cut):
    """Frames that start right go deeper into the checks; still only ProtocolError."""
    raw = (wire.FRAME_MAGIC + bytes([wire.VERSION]) + tail + noise)[: wire.FRAME_HEADER_SIZE - (cut % 2)]
    try:
        fh = wire.decode_frame_header(raw)
    except ProtocolError:
        return
    assert fh.kind in wire.FRAME_KINDS


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=4 + wire.MAX_ABORT_TEXT))
def test_fuzz_abort_payload(payload):
    err = wire.abort_error(payload, 1)
    assert isinstance(err, CommError)


# --- hellos and MACs -------------------------------------------------------------------------


def hello(role=wire.CONNECT, rank=1, peer=0, world=2, prefix="job", secret=True):
    return wire.Hello.fresh(role, secret, rank, peer, world, wire.job_digest(prefix))


def test_hello_round_trip_and_fresh_nonces():
    h = hello()
    assert len(h.pack()) == wire.HELLO_SIZE
    assert wire.Hello.unpack(h.pack()) == h
    assert hello().nonce != h.nonce


@pytest.mark.parametrize(
    "mutate, words",
    [
        (lambda b: b"XXXX" + b[4:], "magic"),
        (lambda b: b[:4] + bytes([99]) + b[5:], "version"),
        (lambda b: b[:5] + bytes([9]) + b[6:], "role"),
        (lambda b: b[:6] + bytes([6, 0]) + b[8:], "flags"),
        (lambda b: b[:8] + struct.pack("<I", 5) + b[12:], "rank 5"),
        (lambda b: b[:8] + struct.pack("<I", 2) + b[12:], "rank 2"),  # rank == world size 2
        (lambda b: b[:12] + struct.pack("<I", 2) + b[16:], "peer 2"),  # peer == world size 2
        (lambda b: b[:16] + struct.pack("<I", 0) + b[20:], "world size 0"),
        (lambda b: b[:-1], "68 bytes"),
    ],
)
def test_malformed_hello(mutate, words):
    with pytest.raises(ProtocolError, match=words):
        wire.Hello.unpack(mutate(hello().pack()))


def test_the_encoders_refuse_what_the_decoders_would_refuse():
    # A frame longer than MAX_PAYLOAD and a hello with a short nonce (struct pads it with
    # zeros: a replayable handshake) fail where they are made, not at the peer or never.
    call = CallHeader(1, "allreduce", op="sum", algorithm="ring", dtype="int64", numel=4)
    for length in (-1, wire.MAX_PAYLOAD + 1):
        with pytest.raises(ValueError, match="payload length"):
            wire.encode_data_header(call, length)
    job = wire.job_digest("job")
    for role, job_, nonce in ((3, job, bytes(32)), (wire.CONNECT, job[:15], bytes(32)), (wire.CONNECT, job, bytes(31))):
        with pytest.raises(ValueError):
            wire.Hello(role, True, 1, 0, 2, job_, nonce)


def test_check_hello_refuses_other_jobs_worlds_and_ranks():
    mine = hello(role=wire.ACCEPT, rank=0, peer=1)
    wire.check_hello(hello(), mine)
    with pytest.raises(ProtocolError, match="another job"):
        wire.check_hello(hello(prefix="other"), mine)
    with pytest.raises(ProtocolError, match="world size"):
        wire.check_hello(hello(world=3), mine)
    with pytest.raises(ProtocolError, match="wanted rank 2"):
        wire.check_hello(hello(peer=2, world=3), hello(role=wire.ACCEPT, rank=0, peer=1, world=3))
    with pytest.raises(ProtocolError, match="role"):
        wire.check_hello(hello(role=wire.ACCEPT, rank=1), mine)
    connector = hello(rank=2, peer=0, world=3)
    with pytest.raises(ProtocolError, match="reached rank 1"):
        wire.check_hello(hello(role=wire.ACCEPT, rank=1, peer=2, world=3), connector)


def test_check_secrets_agree():
    wire.check_secrets_agree(hello(secret=True), True)
    wire.check_secrets_agree(hello(secret=False), False)
    with pytest.raises(AuthError, match="requires"):
        wire.check_secrets_agree(hello(secret=True), False)
    with pytest.raises(AuthError, match="holds no shared secret"):
        wire.check_secrets_agree(hello(secret=False), True)


def test_macs_bind_role_secret_and_both_nonces():
    c, a = hello().pack(), hello(role=wire.ACCEPT, rank=0, peer=1).pack()
    key = b"k" * 32
    mac = wire.handshake_mac(key, wire.CONNECT, c, a)
    assert wire.mac_ok(mac, wire.handshake_mac(key, wire.CONNECT, c, a))
    assert not wire.mac_ok(mac, wire.handshake_mac(key, wire.ACCEPT, c, a))
    assert not wire.mac_ok(mac, wire.handshake_mac(b"other", wire.CONNECT, c, a))
    fresh_accept = hello(role=wire.ACCEPT, rank=0, peer=1).pack()  # a new nonce: a replay fails
    assert not wire.mac_ok(mac, wire.handshake_mac(key, wire.CONNECT, c, fresh_accept))
    assert wire.handshake_mac(None, wire.CONNECT, c, a) == bytes(wire.MAC_SIZE)
    assert key not in mac
    # every byte counts: a MAC differing only in its last byte, or cut short, is refused
    assert not wire.mac_ok(mac, mac[:-1] + bytes([mac[-1] ^ 1]))
    assert not wire.mac_ok(mac, mac[:16])
    assert not wire.mac_ok(mac, mac + b"\0")


def test_an_abort_reason_names_another_kind_of_error_once_and_keeps_a_comm_errors_code():
    # Every transport words an ABORT with it; Ctrl-C read "KeyboardInterrupt: KeyboardInterrupt".
    from ringtrain.errors import CommTimeout, MismatchError, PeerLost, abort_reason

    class SlowPeer(CommTimeout):
        pass

    assert abort_reason(KeyboardInterrupt()) == (0, "KeyboardInterrupt")
    assert abort_reason(ValueError("bad")) == (0, "ValueError: bad")
    assert abort_reason(PeerLost("rank 1 is gone")) == (2, "rank 1 is gone")
    assert abort_reason(MismatchError()) == (3, "MismatchError")
    assert abort_reason(SlowPeer("late")) == (1, "late")
