"""The shared secret: sealed side-channel frames, the replay guard, signed registry records,
loading the keys, and the producer allowlist (pure functions, an injected clock)."""

from __future__ import annotations

import pytest

from mooncake_vllm.core import auth
from mooncake_vllm.core.auth import (
    NONCE_BYTES,
    REPLAY_WINDOW_S,
    REPLY,
    REQUEST,
    AuthError,
    ReplayGuard,
    host_allowed,
    is_loopback,
    load_keys,
    open_frame,
    open_record,
    seal_frame,
    seal_record,
)

KEY = auth.new_secret().encode()
NEW_KEY = auth.new_secret().encode()
OTHER_KEY = auth.new_secret().encode()
BODY = b"\x82\xa4type\xaaacquire/2"  # any bytes: the frame's msgpack, for auth
NOW_S = 1_700_000_000.0
TAG_BYTES = 32


# ---- frames ---------------------------------------------------------------------------------


def test_a_sealed_request_opens_with_its_time_and_nonce():
    frame, nonce = seal_frame((KEY,), BODY, REQUEST, now_s=NOW_S)
    assert len(nonce) == NONCE_BYTES and BODY in frame and frame.startswith(b"MVA2")
    assert open_frame((KEY,), frame, REQUEST) == (BODY, int(1000 * NOW_S), nonce)


def test_every_seal_has_a_fresh_nonce():
    nonces = {seal_frame((KEY,), BODY, REQUEST)[1] for _ in range(100)}
    assert len(nonces) == 100


def test_without_keys_a_frame_is_its_body():
    assert seal_frame((), BODY, REQUEST) == (BODY, b"")
    assert open_frame((), BODY, REQUEST) == (BODY, 0, b"")


def _flip(data: bytes, index: int) -> bytes:
    return data[:index] + bytes([data[index] ^ 1]) + data[index + 1 :]


HEADER_BYTES = len(b"MVA2") + 1 + 8 + NONCE_BYTES


@pytest.mark.parametrize(
    "where",
    [
        HEADER_BYTES,  # the body's first byte
        -TAG_BYTES - 1,  # the body's last byte
        -1,  # the tag
        -TAG_BYTES,
        4,  # the direction
        5,  # the time
        HEADER_BYTES - 1,  # the nonce
    ],
)
def test_a_tampered_frame_does_not_open(where):
    frame, _ = seal_frame((KEY,), BODY, REQUEST, now_s=NOW_S)
    index = where % len(frame)
    with pytest.raises(AuthError, match="bad signature"):
        open_frame((KEY,), _flip(frame, index), REQUEST)


@pytest.mark.parametrize(
    "frame",
    [
        b"",
        BODY,  # a peer without the secret sends the bare frame
        b"MVA2",
        b"XXXX" + seal_frame((KEY,), BODY, REQUEST)[0][4:],  # another magic
        seal_frame((KEY,), BODY, REQUEST)[0][: HEADER_BYTES + TAG_BYTES - 1],  # truncated
    ],
    ids=["empty", "bare", "magic only", "other magic", "truncated"],
)
def test_a_frame_that_is_not_sealed_is_unauthenticated(frame):
    with pytest.raises(AuthError, match="unauthenticated"):
        open_frame((KEY,), frame, REQUEST)


def test_an_appended_or_cut_body_does_not_open():
    frame, _ = seal_frame((KEY,), BODY, REQUEST)
    with pytest.raises(AuthError, match="bad signature"):
        open_frame((KEY,), frame[:HEADER_BYTES] + BODY + b"x" + frame[-TAG_BYTES:], REQUEST)
    with pytest.raises(AuthError, match="bad signature"):
        open_frame((KEY,), frame[:HEADER_BYTES] + BODY[:-1] + frame[-TAG_BYTES:], REQUEST)


def test_a_frame_sealed_with_another_key_does_not_open():
    frame, _ = seal_frame((OTHER_KEY,), BODY, REQUEST)
    with pytest.raises(AuthError, match="bad signature"):
        open_frame((KEY,), frame, REQUEST)


def test_key_rotation_any_key_verifies_the_first_signs():
    # Step 1 of a rotation: the new key added second everywhere. Step 2: moved first.
    old_first, new_first = (KEY, NEW_KEY), (NEW_KEY, KEY)
    signed_old, _ = seal_frame(old_first, BODY, REQUEST)
    signed_new, _ = seal_frame(new_first, BODY, REQUEST)
    for keys in (old_first, new_first):
        assert open_frame(keys, signed_old, REQUEST)[0] == BODY
        assert open_frame(keys, signed_new, REQUEST)[0] == BODY
    assert open_frame((KEY,), signed_old, REQUEST)[0] == BODY  # signed with the first key ...
    with pytest.raises(AuthError):
        open_frame((KEY,), signed_new, REQUEST)  # ... so a peer without the new key refuses it
    with pytest.raises(AuthError):
        open_frame((NEW_KEY,), signed_old, REQUEST)  # step 3: the old key dropped


def test_a_request_is_not_a_reply_and_a_reply_not_a_request():
    request, nonce = seal_frame((KEY,), BODY, REQUEST)
    reply, _ = seal_frame((KEY,), BODY, REPLY, nonce)
    with pytest.raises(AuthError):
        open_frame((KEY,), request, REPLY, nonce)  # a request reflected back as its answer
    with pytest.raises(AuthError):
        open_frame((KEY,), reply, REQUEST)
    # The direction is signed: rewriting it breaks the tag.
    forged = reply[:4] + REQUEST + reply[5:]
    with pytest.raises(AuthError):
        open_frame((KEY,), forged, REQUEST)


def test_a_sealed_frame_with_the_wrong_direction_says_so():
    # Same context (empty), so the tag verifies and only the direction differs.
    reply, _ = seal_frame((KEY,), BODY, REPLY)
    with pytest.raises(AuthError, match="wrong direction"):
        open_frame((KEY,), reply, REQUEST)


def test_a_reply_opens_only_for_the_request_it_answers():
    _, nonce_a = seal_frame((KEY,), BODY, REQUEST)
    _, nonce_b = seal_frame((KEY,), BODY, REQUEST)
    reply_a, _ = seal_frame((KEY,), BODY, REPLY, nonce_a)
    assert open_frame((KEY,), reply_a, REPLY, nonce_a)[0] == BODY
    with pytest.raises(AuthError, match="bad signature"):
        open_frame((KEY,), reply_a, REPLY, nonce_b)  # an old reply replayed to a later request
    with pytest.raises(AuthError):
        open_frame((KEY,), reply_a, REPLY)  # nor without a request


# ---- replay guard ---------------------------------------------------------------------------


class FakeClock:
    def __init__(self, now_s: float = NOW_S) -> None:
        self.now_s = now_s

    def __call__(self) -> float:
        return self.now_s


def _ms(s: float) -> int:
    return int(1000 * s)


def test_a_nonce_is_accepted_once_within_the_window():
    clock = FakeClock()
    guard = ReplayGuard(window_s=30.0, clock=clock)
    guard.check(_ms(NOW_S), b"n1")
    guard.check(_ms(NOW_S), b"n2")
    with pytest.raises(AuthError, match="replayed"):
        guard.check(_ms(NOW_S), b"n1")
    clock.now_s += 29.0
    with pytest.raises(AuthError, match="replayed"):
        guard.check(_ms(NOW_S), b"n1")  # still remembered while its time is in the window


@pytest.mark.parametrize("offset_s", [-30.001, 30.001, -3600.0, 3600.0, -NOW_S])
def test_a_request_outside_the_window_is_stale(offset_s):
    guard = ReplayGuard(window_s=30.0, clock=FakeClock())
    with pytest.raises(AuthError, match="stale"):
        guard.check(_ms(NOW_S + offset_s), b"n1")


@pytest.mark.parametrize("offset_s", [-30.0, -1.0, 0.0, 1.0, 30.0])
def test_clock_skew_within_the_window_is_accepted(offset_s):
    ReplayGuard(window_s=30.0, clock=FakeClock()).check(_ms(NOW_S + offset_s), b"n1")


def test_a_replay_after_the_window_is_stale_not_remembered():
    clock = FakeClock()
    guard = ReplayGuard(window_s=30.0, clock=clock)
    guard.check(_ms(NOW_S), b"n1")
    clock.now_s += 31.0
    with pytest.raises(AuthError, match="stale"):
        guard.check(_ms(NOW_S), b"n1")
    assert len(guard._seen) == 0  # forgotten: its time alone refuses it now


def test_the_guard_remembers_at_most_max_nonces():
    guard = ReplayGuard(window_s=30.0, clock=FakeClock(), max_nonces=3)
    for i in range(10):
        guard.check(_ms(NOW_S), b"n%d" % i)
    assert len(guard._seen) <= 3
    with pytest.raises(AuthError, match="replayed"):
        guard.check(_ms(NOW_S), b"n9")  # the newest are kept


def test_the_default_window_is_the_documented_one():
    assert REPLAY_WINDOW_S == 30.0


# ---- keys -----------------------------------------------------------------------------------


def test_keys_from_a_file_one_per_line(tmp_path):
    path = tmp_path / "secret"
    path.write_text(f"\n  {KEY.decode()}  \n\n{NEW_KEY.decode()}\n")
    assert load_keys(str(path), None) == (KEY, NEW_KEY)


def test_keys_from_an_environment_variable():
    assert load_keys(None, "MV_SECRET", environ={"MV_SECRET": KEY.decode()}) == (KEY,)


def test_no_secret_means_no_keys():
    assert load_keys(None, None, environ={}) == ()
    assert load_keys("", "", environ={}) == ()


@pytest.mark.parametrize(
    ("file_text", "env", "match"),
    [
        ("x" * 32, {"MV_SECRET": "x" * 32}, "auth_secret_file or auth_secret_env, not both"),
        (None, {}, "auth_secret_env='MV_SECRET': the environment variable is not set"),
        ("", None, "auth_secret_file=.*: the secret is empty"),
        ("\n  \n", None, "the secret is empty"),
        (None, {"MV_SECRET": ""}, "auth_secret_env='MV_SECRET': the secret is empty"),
        ("short", None, "key 1 has fewer than 16 bytes; use e.g."),
        ("x" * 32 + "\nshort\n", None, "key 2 has fewer than 16 bytes"),
        (None, {"MV_SECRET": "x" * 15}, "auth_secret_env='MV_SECRET': key 1 has fewer than 16"),
    ],
)
def test_a_bad_secret_is_refused_naming_the_setting(tmp_path, file_text, env, match):
    secret_file = None
    if file_text is not None:
        secret_file = tmp_path / "secret"
        secret_file.write_text(file_text)
        secret_file = str(secret_file)
    secret_env = "MV_SECRET" if env is not None else None
    with pytest.raises(ValueError, match=match):
        load_keys(secret_file, secret_env, environ=env or {})


def test_a_missing_secret_file_is_refused_naming_it(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(ValueError, match=rf"auth_secret_file='{missing}' cannot be read"):
        load_keys(str(missing), None)


def test_new_secret_is_long_enough_and_random():
    a, b = auth.new_secret(), auth.new_secret()
    assert a != b and len(a.encode()) >= auth.SECRET_MIN_BYTES
    assert load_keys(None, "S", environ={"S": a}) == (a.encode(),)


# ---- records in the metadata store -----------------------------------------------------------

RECORD = b'{"engine_id":"prefill","side_channel":"10.0.0.1:16001"}'


def test_a_signed_record_opens_with_any_of_the_keys():
    signed = seal_record((KEY,), RECORD)
    assert signed.startswith(auth.RECORD_MAGIC) and signed != RECORD
    assert open_record((KEY,), signed) == RECORD
    assert open_record((OTHER_KEY, KEY), signed) == RECORD  # rotation


def test_without_keys_records_are_written_as_they_are_and_read_either_way():
    assert seal_record((), RECORD) == RECORD
    assert open_record((), RECORD) == RECORD
    assert open_record((), seal_record((KEY,), RECORD)) == RECORD  # read unverified


def test_with_keys_an_unsigned_record_is_refused():
    with pytest.raises(AuthError, match="unsigned record"):
        open_record((KEY,), RECORD)


@pytest.mark.parametrize(
    "forge",
    [
        lambda signed: seal_record((OTHER_KEY,), RECORD),  # signed with another secret
        lambda signed: signed.replace(b"10.0.0.1", b"10.6.6.6"),  # another side channel
        lambda signed: signed + b" ",
        lambda signed: signed[:-1],
        lambda signed: _flip(signed, len(auth.RECORD_MAGIC)),  # the tag
        lambda signed: auth.RECORD_MAGIC + b" " + RECORD,  # no tag
        lambda signed: auth.RECORD_MAGIC,
    ],
    ids=["other key", "record changed", "appended", "cut", "tag changed", "no tag", "empty"],
)
def test_with_keys_a_forged_record_is_refused(forge):
    with pytest.raises(AuthError, match="bad record signature"):
        open_record((KEY,), forge(seal_record((KEY,), RECORD)))


# ---- hosts ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("host", "allowed", "expected"),
    [
        ("10.0.0.1", ["10.0.0.1"], True),
        ("10.0.0.2", ["10.0.0.1"], False),
        ("10.0.0.7", ["10.0.0.0/24"], True),
        ("10.0.1.7", ["10.0.0.0/24"], False),
        ("10.0.0.7", ["10.0.0.5/24"], True),  # host bits set: taken as its network
        ("10.0.0.7", ["192.168.0.0/16", "10.0.0.0/8"], True),
        ("fd00::5", ["fd00::/64"], True),
        ("fd01::5", ["fd00::/64"], False),
        ("::1", ["::1"], True),
        ("10.0.0.1", ["::/0"], False),  # another family never matches
        ("prefill-0.cluster", ["prefill-0.cluster"], True),
        ("prefill-1.cluster", ["prefill-0.cluster"], False),
        ("prefill-0.cluster", ["10.0.0.0/8"], False),  # names are not resolved
        ("prefill", ["prefill-0.cluster", "not a network", "10.0.0.0/8"], False),
        ("10.0.0.1", ["not a network", "10.0.0.1/32"], True),  # a bad entry is skipped
        ("", ["10.0.0.0/8"], False),
        ("10.0.0.1", [], False),
    ],
)
def test_host_allowed(host, allowed, expected):
    assert host_allowed(host, allowed) is expected


@pytest.mark.parametrize(
    ("host", "expected"),
    [
        ("127.0.0.1", True),
        ("127.0.0.4", True),
        ("::1", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("10.0.0.1", False),
        ("::", False),
        ("prefill-0", False),
        ("", False),
    ],
)
def test_is_loopback(host, expected):
    assert is_loopback(host) is expected


def test_short_id_is_a_prefix_too_short_to_act_on():
    tid = "0123456789abcdef" * 2
    assert auth.short_id(tid) == "01234567"
    assert auth.short_id("t-1") == "t-1"
