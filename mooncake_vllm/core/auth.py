"""Shared-secret authentication: side-channel frames and records in the metadata store.

The secret is read from a file or from an environment variable named in the config, never from a
command line. Each non-empty line is one key: the first signs, every one verifies, so a secret is
rotated without downtime by adding the new key as a second line everywhere, then moving it first,
then dropping the old one (``docs/security.md``).

Side-channel frames are sealed with HMAC-SHA256 (``seal_frame``/``open_frame``):

    b"MVA2" | direction (1) | time_ms (8, big-endian) | nonce (16) | body | tag (32)

The tag covers the direction, the time, the nonce, a *context* and the body. A request's context
names the channel it is sent to (the side channel's ``channel_context``: its producer rank's
port), so a request captured on one rank's channel does not verify on a sibling's; a reply's
context is the nonce of the request it answers, so an old reply replayed to a later request does
not verify. ``MVA1`` frames (requests sealed with an empty context, before ``MVA2``) are refused
as from an older version. The receiver of requests refuses a time outside ``REPLAY_WINDOW_S``
and a nonce it has seen within the window (``ReplayGuard``). Why HMAC and not ZeroMQ's CURVE: CURVE
authenticates a connection by key pairs (a ZAP handler per socket, a key pair per engine to
distribute) and encrypts every byte; a shared secret, one tag per frame and no handshake cost the
same to deploy as the secret itself, and the tag binds each reply to its request.

Records (``seal_record``/``open_record``): ``b"MVSIG1 " + hex tag + b" " + record``.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import secrets
import struct
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

FRAME_MAGIC = b"MVA2"
# Sealed by a version whose requests named no channel: refused with a reason saying so.
_OLD_FRAME_MAGICS = (b"MVA1",)
REQUEST, REPLY = b"q", b"r"
_HEADER = struct.Struct(">4sc Q 16s")  # magic, direction, time_ms, nonce
_TAG_BYTES = 32
NONCE_BYTES = 16
# A request older or newer than this (the hosts' clocks included) is refused as a replay.
REPLAY_WINDOW_S = 30.0
SECRET_MIN_BYTES = 16
RECORD_MAGIC = b"MVSIG1 "


class AuthError(ValueError):
    """A frame or record that does not verify (the reason, for counting; never sent back)."""


Keys = tuple[bytes, ...]  # the first signs, every one verifies; empty: authentication off


def read_key_lines(
    path: str | None,
    variable: str | None,
    environ: Mapping[str, str],
    *,
    path_setting: str,
    variable_setting: str,
    file_holds: str,
    export_in: str,
    when_empty: str,
) -> tuple[tuple[str, ...], str] | None:
    """The stripped non-blank lines of the file ``path`` or of the environment variable
    ``variable`` (the caller allows only one), with how the config names that setting
    (``path_setting`` or ``variable_setting``, for the caller's own errors); None when neither
    is given. Raises ValueError naming the setting and the fix when the file cannot be read
    (``file_holds``: what it should hold) or the variable is not set (``export_in``: where to
    export it), or when it holds no line (``when_empty``: what to say). Shared by the
    connectors' secret and the proxy's API keys."""
    if path is not None:
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise ValueError(
                f"{path_setting} cannot be read ({e.strerror}); point it to a file holding "
                f"{file_holds}"
            ) from e
        where = path_setting
    elif variable is not None:
        if variable not in environ:
            raise ValueError(
                f"{variable_setting}: the environment variable is not set; export it in {export_in}"
            )
        text = environ[variable]
        where = variable_setting
    else:
        return None
    lines = tuple(line.strip() for line in text.splitlines() if line.strip())
    if not lines:
        raise ValueError(f"{where}: {when_empty}")
    return lines, where


def load_keys(
    secret_file: str | None, secret_env: str | None, environ: Mapping[str, str] | None = None
) -> Keys:
    """The keys named by the config; ``()`` when neither is set. Raises ValueError naming the
    setting and the fix (the caller turns it into its config error)."""
    environ = os.environ if environ is None else environ
    if secret_file and secret_env:
        raise ValueError("set auth_secret_file or auth_secret_env, not both")
    found = read_key_lines(
        secret_file or None,  # an empty setting is no setting
        secret_env or None,
        environ,
        path_setting=f"auth_secret_file={secret_file!r}",
        variable_setting=f"auth_secret_env={secret_env!r}",
        file_holds="the shared secret (one key per line)",
        export_in="the server's environment (never on the command line)",
        when_empty="the secret is empty",
    )
    if found is None:
        return ()
    lines, where = found
    keys = tuple(line.encode() for line in lines)
    short = [i for i, k in enumerate(keys) if len(k) < SECRET_MIN_BYTES]
    if short:
        raise ValueError(
            f"{where}: key {short[0] + 1} has fewer than {SECRET_MIN_BYTES} bytes; use e.g. "
            "`python -c 'import secrets; print(secrets.token_hex(32))'`"
        )
    return keys


def new_secret() -> str:
    return secrets.token_hex(32)


def _tag(key: bytes, header: bytes, context: bytes, body: bytes) -> bytes:
    mac = hmac.new(key, header, hashlib.sha256)
    mac.update(struct.pack(">H", len(context)))
    mac.update(context)
    mac.update(body)
    return mac.digest()


def seal_frame(
    keys: Keys,
    body: bytes,
    direction: bytes,
    context: bytes = b"",
    *,
    now_s: float | None = None,
    nonce: bytes | None = None,
) -> tuple[bytes, bytes]:
    """``(frame, nonce)``: the body sealed with the first key (as is when ``keys`` is empty)."""
    if not keys:
        return body, b""
    nonce = secrets.token_bytes(NONCE_BYTES) if nonce is None else nonce
    now_ms = int(1000 * (time.time() if now_s is None else now_s))
    header = _HEADER.pack(FRAME_MAGIC, direction, now_ms, nonce)
    return header + body + _tag(keys[0], header, context, body), nonce


def open_frame(
    keys: Keys, frame: bytes, direction: bytes, context: bytes = b""
) -> tuple[bytes, int, bytes]:
    """``(body, time_ms, nonce)`` of a frame that verifies under one of ``keys``; AuthError
    otherwise. With no keys the frame is the body (time 0, no nonce)."""
    if not keys:
        return frame, 0, b""
    if len(frame) < _HEADER.size + _TAG_BYTES or not frame.startswith(FRAME_MAGIC):
        if frame.startswith(_OLD_FRAME_MAGICS):
            raise AuthError("sealed by an older version (upgrade both sides)")
        raise AuthError("unauthenticated")
    header = frame[: _HEADER.size]
    _, got_direction, time_ms, nonce = _HEADER.unpack(header)
    body, tag = frame[_HEADER.size : -_TAG_BYTES], frame[-_TAG_BYTES:]
    if not any(hmac.compare_digest(_tag(k, header, context, body), tag) for k in keys):
        raise AuthError("bad signature")
    if got_direction != direction:
        raise AuthError("wrong direction")
    return body, time_ms, nonce


class ReplayGuard:
    """Refuses a request whose time is outside the window or whose nonce was seen within it.
    Bounded: only authenticated frames reach it, and at most ``max_nonces`` are remembered (the
    oldest go first; their times leave the window soon after at any sane rate)."""

    def __init__(
        self,
        window_s: float = REPLAY_WINDOW_S,
        clock: Callable[[], float] = time.time,
        max_nonces: int = 1 << 20,
    ):
        self._window_ms = int(1000 * window_s)
        self._clock = clock
        self._seen: OrderedDict[bytes, int] = OrderedDict()  # nonce -> its frame's time
        self._max = max_nonces

    def check(self, time_ms: int, nonce: bytes) -> None:
        now_ms = int(1000 * self._clock())
        while self._seen:
            oldest_nonce, oldest_ms = next(iter(self._seen.items()))
            if oldest_ms >= now_ms - self._window_ms and len(self._seen) < self._max:
                break
            del self._seen[oldest_nonce]
        if abs(now_ms - time_ms) > self._window_ms:
            raise AuthError("stale")
        if nonce in self._seen:
            raise AuthError("replayed")
        self._seen[nonce] = time_ms


def seal_record(keys: Keys, record: bytes) -> bytes:
    """A record for the metadata store, signed with the first key (as is without keys)."""
    if not keys:
        return record
    tag = hmac.new(keys[0], record, hashlib.sha256).hexdigest().encode()
    return RECORD_MAGIC + tag + b" " + record


def open_record(keys: Keys, data: bytes) -> bytes:
    """The record inside ``data``; AuthError if keys are set and it is unsigned or forged.
    Without keys a signed record is read unverified (the reader trusts its store)."""
    if not data.startswith(RECORD_MAGIC):
        if keys:
            raise AuthError("unsigned record")
        return data
    tag, _, record = data[len(RECORD_MAGIC) :].partition(b" ")
    if keys and not any(
        hmac.compare_digest(hmac.new(k, record, hashlib.sha256).hexdigest().encode(), tag)
        for k in keys
    ):
        raise AuthError("bad record signature")
    return record


def short_id(transfer_id: str) -> str:
    """What logs show of a transfer id: a prefix, never enough to act on it (32 of its 128 or
    122 random bits; upstream's ``xfer-<uuid>`` keeps its ``xfer-``)."""
    return transfer_id[:13] if transfer_id.startswith("xfer-") else transfer_id[:8]


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_allowed(host: str, allowed: Sequence[str]) -> bool:
    """``host`` (an IP or a name) matches an entry of ``allowed``: an IP, a CIDR or a name."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        ip = None
    for entry in allowed:
        if entry == host:
            return True
        if ip is not None:
            try:
                if ip in ipaddress.ip_network(entry, strict=False):
                    return True
            except ValueError:
                continue
    return False
