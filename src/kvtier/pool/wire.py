"""The pool's wire: messages between a vLLM instance and the node's meta service.

Runs on both ends of one local socket (Unix, or TCP on loopback unless
configured). Only the index travels here: keys, slot numbers, counters.
Block data never crosses the socket; workers of every instance map the
service's DRAM arena and copy themselves.

Framing: a 4-byte little-endian length, then one MessagePack message
(msgspec, typed: no pickle, nothing but these structs decodes). Every
message is a tagged struct; a frame longer than :data:`MAX_FRAME`, a
truncated one, an unknown tag, a wrong field type or keys that are not a
whole number of 16-byte keys is refused with :class:`WireError`, and the service answers it with
:class:`Error` (or closes that one connection) while serving the others.

A session opens with :class:`Hello` (protocol version, optional shared
token, the instance's slot geometry, its scheduler's wait for moves) and
the service answers
:class:`Welcome` (session id, arena path, slots, the paths of the counters
page and the ready index to map) or :class:`Error`. Then each request
carries an id the reply repeats; :class:`Touch` alone is never answered.
"""

from __future__ import annotations

import re
import socket
import struct
import time
from collections.abc import Sequence
from typing import Annotated

import msgspec
import numpy as np

from kvtier.config import SECONDS_MAX
from kvtier.keys import KEY_BYTES, KEY_DTYPE

# 2: ProbeReply.remote (the cluster tier); 3: keys as one blob, Welcome.stats;
# 4: Hello.promote_timeout_ms; 5: Welcome.ready, Touch; 6: Touch.times
PROTOCOL_VERSION = 6
MAX_FRAME = 8 << 20  # bytes: 64k tokens of 16-token blocks are 64 KiB of keys
TOUCH_TIMES_MAX = 1 << 20  # lookups one Touch may count
# An engine's steps count up from 0; a service's own reset dooms every step
# above -2**62 (service._LOW_STEP), so no step of a session may be at or below it.
Step = Annotated[int, msgspec.Meta(ge=0, lt=1 << 62)]
AfterStep = Annotated[int, msgspec.Meta(ge=-1, lt=1 << 62)]  # -1: before the first step
PROMOTE_TIMEOUT_MS_MAX = int(SECONDS_MAX * 1000)  # the longest wait a config takes
NAME_MAX = 200  # characters of an instance's name as the service keeps it (instance_name)
# An instance's name goes into log lines and /metrics labels. The wire only
# bounds it; the service makes it fit with instance_name(), so that a
# client of this protocol version whose name does not fit still connects.
InstanceName = Annotated[str, msgspec.Meta(max_length=4096)]
_NOT_IN_NAMES = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def instance_name(name: str) -> str:
    """``name`` as logs and labels take it: control characters and line
    separators become "?", a name too long keeps its end (where the process
    id is), and a leading "(" goes (the service's own labels start with one)."""
    return _NOT_IN_NAMES.sub("?", name)[-NAME_MAX:].lstrip("(")


NAMED_MAX = 4096  # bytes of a refused message decoded again to name its field (see _named)
_LEN = struct.Struct("<I")
# Block keys travel as one bytes field, 16 bytes each back to back
# (pack_keys / unpack_keys): a list of 4,096 MessagePack strings took ~65 us
# to encode and as long to decode; one blob is a copy, split in C.
Keys = bytes
# DRAM slot numbers as one bytes field, 4 bytes each ("<i4"), back to back.
Slots32 = bytes
SLOT_BYTES = 4


class WireError(Exception):
    """A frame or message that breaks the protocol."""


class _Msg(msgspec.Struct, tag=True, array_like=True, forbid_unknown_fields=True):
    pass


# --- handshake --------------------------------------------------------------

class Hello(_Msg):
    version: int
    token: str
    name: InstanceName  # the instance, for logs and per-instance metrics ("": named by its pid)
    pid: int
    ranks: int  # ranks writing parts of each block
    rank_bytes: int  # bytes of each rank's part
    # How long the instance's scheduler waits for a move into DRAM (its
    # promote_timeout_s): the pool counts a move as stalled no sooner. Last,
    # with a default, so that an older client's Hello decodes and is told
    # its version is wrong.
    promote_timeout_ms: Annotated[int, msgspec.Meta(ge=0, le=PROMOTE_TIMEOUT_MS_MAX)] = 0


class Welcome(_Msg):
    version: int
    session: int
    arena: str  # path of the DRAM arena to map
    num_slots: int
    lease_ttl_ms: int
    ssd: bool
    stats: str  # path of the counters page to map ("" if none): pool/statspage.py
    ready: str  # path of the ready index to map ("" if none): pool/readymap.py


# --- requests (each with an id the reply repeats) ---------------------------

class Probe(_Msg):
    id: int
    keys: Keys
    # The DRAM slots of a run the instance counted in the shared ready index
    # (pool/readymap.py) just before ``keys``, first block first: counted
    # with this lookup and stamped as a Touch's, more recent than ``keys``.
    ahead: Slots32 = b""


class Touch(_Msg):
    """A lookup the instance answered itself from the ready index
    (pool/readymap.py): the DRAM slots of the run it counted, first block
    first, for the service to count as a lookup and to refresh the
    blocks' recency. Never answered: the instance does not wait. The
    instance sends it with its next call, not at once (pool/client.py):
    ``times`` lookups of the same run in the meantime come as one."""

    id: int
    slots: Slots32
    times: Annotated[int, msgspec.Meta(ge=1, le=TOUCH_TIMES_MAX)] = 1


class Promote(_Msg):
    id: int
    keys: Keys


class Pin(_Msg):
    id: int
    step: Step
    keys: Keys


class PrepareSave(_Msg):
    id: int
    step: Step
    keys: Keys


class CompleteStep(_Msg):
    id: int
    step: Step
    failed_slots: list[int]
    all_failed: bool  # not every rank finished: nothing of the step may be read


class AbandonSaves(_Msg):
    id: int
    step: Step


class Discard(_Msg):
    id: int
    keys: Keys


class DoomPending(_Msg):
    id: int
    after_step: AfterStep


class Reset(_Msg):
    """The instance's weights changed: its saves in flight are dropped."""

    id: int


class Counters(_Msg):
    id: int


class WaitProgress(_Msg):
    id: int
    timeout_ms: int


class Ping(_Msg):
    """Keeps the session's leases alive while the instance is idle."""

    id: int


Request = Probe | Touch | Promote | Pin | PrepareSave | CompleteStep | AbandonSaves | Discard | DoomPending | \
    Reset | Counters | WaitProgress | Ping


# --- replies ----------------------------------------------------------------

class ProbeReply(_Msg):
    id: int
    ready: int
    total: int
    remote: int = 0  # of ``total``, the last ones held only in the cluster tier (protocol 2)


class Count(_Msg):
    id: int
    n: int


class Slots(_Msg):
    id: int
    slots: list[int]  # -1: none
    placed: int


class CounterValues(_Msg):
    id: int
    values: dict[str, int]


class Ok(_Msg):
    id: int


class Error(_Msg):
    id: int  # 0 when the message had no readable id
    code: str  # "version", "auth", "geometry", "bad-request", "config", "internal", "stopping", "expired"
    message: str


Reply = ProbeReply | Count | Slots | CounterValues | Ok | Error

ClientMessage = Hello | Request
ServerMessage = Welcome | Reply

_encoder = msgspec.msgpack.Encoder()
_client_decoder = msgspec.msgpack.Decoder(ClientMessage)
_server_decoder = msgspec.msgpack.Decoder(ServerMessage)


def pack_keys(keys: Sequence[bytes]) -> bytes:
    """Block keys as the wire carries them: the buffer of a :class:`KeyRun`
    that has one, the keys joined otherwise."""
    packed = getattr(keys, "packed", None)
    if packed is not None and len(packed) == KEY_BYTES * len(keys):
        return packed
    blob = b"".join(keys)
    # The total only: the keys are kvtier's own digests. Checking each one
    # (even in C, min(map(len, keys))) cost 60 us for 4,096 keys, three
    # times the join; a wrong key can only miss.
    if len(blob) != KEY_BYTES * len(keys):
        raise ValueError(f"block keys must be {KEY_BYTES} bytes each")
    return blob


def unpack_keys(blob: bytes) -> list[bytes]:
    """The keys of a message that :func:`decode_client` accepted."""
    return np.frombuffer(blob, dtype=KEY_DTYPE).tolist()


def encode(msg: msgspec.Struct) -> bytes:
    body = _encoder.encode(msg)
    if len(body) > MAX_FRAME:
        raise WireError(f"message of {len(body)} bytes is over the {MAX_FRAME}-byte limit")
    return _LEN.pack(len(body)) + body


def decode_client(body: bytes) -> ClientMessage:
    """A message from an instance, schema-checked; keys must be whole 16-byte keys."""
    try:
        msg = _client_decoder.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as err:
        raise WireError(_named(str(err), body)) from None
    keys = getattr(msg, "keys", None)
    if keys is not None and len(keys) % KEY_BYTES:
        raise WireError(f"{type(msg).__name__}.keys: {len(keys)} bytes is not a whole number of "
                        f"{KEY_BYTES}-byte keys")
    slots = msg.slots if isinstance(msg, Touch) else msg.ahead if isinstance(msg, Probe) else b""
    if len(slots) % SLOT_BYTES:
        field = "Touch.slots" if isinstance(msg, Touch) else "Probe.ahead"
        raise WireError(f"{field}: {len(slots)} bytes is not a whole number of {SLOT_BYTES}-byte slots")
    return msg


def decode_server(body: bytes) -> ServerMessage:
    try:
        return _server_decoder.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as err:
        raise WireError(_named(str(err), body)) from None


_BY_TAG: dict[str, type[_Msg]] = {cls.__name__: cls for cls in _Msg.__subclasses__()}
_AT = re.compile(r"`\$\[(\d+)\]")


def _named(error: str, body: bytes) -> str:
    """msgspec's error with the message and field named: structs travel as
    arrays (tag first), so msgspec says where as ``$[i]``; this says
    ``Pin.step`` instead, and which message an error of its length was in.
    Only on the error path, and only for a body of at most
    :data:`NAMED_MAX` bytes: the body is decoded again, untyped, and a
    large one (an array of millions of empty arrays) took seconds and
    hundreds of MB holding the interpreter lock; its error keeps msgspec's words."""
    if len(body) > NAMED_MAX:
        return error
    try:
        raw = msgspec.msgpack.decode(body)
    except Exception:  # noqa: BLE001 - naming is a courtesy: nested too deep, anything, and msgspec's words stand
        return error
    cls = _BY_TAG.get(raw[0]) if isinstance(raw, list) and raw and isinstance(raw[0], str) else None
    if cls is None:
        return error
    fields = cls.__struct_fields__

    def field(m: re.Match) -> str:
        i = int(m.group(1)) - 1  # $[0] is the tag
        return f"`{cls.__name__}.{fields[i]}" if 0 <= i < len(fields) else m.group(0)

    named = _AT.sub(field, error)
    return named if named != error else f"{cls.__name__}: {error}"


def recv_frame(sock: socket.socket, max_bytes: int = MAX_FRAME, deadline: float | None = None) -> bytes | None:
    """One frame's body; None when the peer closed between frames.

    ``deadline`` (``time.monotonic()``): the whole frame must have arrived
    by then, else TimeoutError. A socket's own timeout bounds each read
    alone: a peer sending a byte a little more often than that would keep
    the read going for ever."""
    head = _recv_exact(sock, _LEN.size, allow_eof=True, deadline=deadline)
    if head is None:
        return None
    (n,) = _LEN.unpack(head)
    if n > max_bytes:
        raise WireError(f"frame of {n} bytes announced, over the {max_bytes}-byte limit")
    body = _recv_exact(sock, n, allow_eof=False, deadline=deadline)
    assert body is not None
    return body


def time_left(sock: socket.socket, deadline: float) -> None:
    """``sock``'s timeout: what is left until ``deadline``; TimeoutError if nothing is."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the call did not end in time")
    sock.settimeout(left)


def _recv_exact(sock: socket.socket, n: int, allow_eof: bool, deadline: float | None = None) -> bytes | None:
    # One call for the whole frame in the common case (a probe of 4,096 keys
    # is a 64 KiB frame): no chunks joined, no second copy.
    if deadline is not None:
        time_left(sock, deadline)
    first = sock.recv(n, socket.MSG_WAITALL)
    if len(first) == n:
        return first
    if not first and allow_eof:
        return None
    buf = bytearray(first)
    while len(buf) < n:
        if deadline is not None:
            time_left(sock, deadline)
        chunk = sock.recv(n - len(buf))
        if not chunk:
            if allow_eof and not buf:
                return None
            raise WireError(f"connection closed inside a frame ({len(buf)} of {n} bytes)")
        buf += chunk
    return bytes(buf)
