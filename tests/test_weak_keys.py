"""Weak Ed25519 public keys: every small-order point and every non-canonical encoding is refused
wherever a key is parsed, so that no signature verifies without a private key."""

from __future__ import annotations

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from helpers import train_tiny
from lbhelpers import make_settings

from witness.bundle.reader import open_bundle
from witness.commit import ed25519
from witness.commit.signing import generate_key, public_hex, public_key_from_hex
from witness.errors import MalformedInput
from witness.verify import Policy, Verifier

P = 2**255 - 19
SIGN = 1 << 255
# The eight points of small order (orders 1, 2, 4, 4, 8, 8, 8, 8), as the libsodium blocklist has them.
SMALL_ORDER = [
    "0100000000000000000000000000000000000000000000000000000000000000",
    "ecffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff7f",
    "0000000000000000000000000000000000000000000000000000000000000000",
    "0000000000000000000000000000000000000000000000000000000000000080",
    "26e8958fc2b227b045c3f489f2ef98f0d5dfac05d3c63339b13802886d53fc05",
    "26e8958fc2b227b045c3f489f2ef98f0d5dfac05d3c63339b13802886d53fc85",
    "c7176a703d4dd84fba3c0b760d10670f2a2053fa2c39ccc64ec7fd7792ac037a",
    "c7176a703d4dd84fba3c0b760d10670f2a2053fa2c39ccc64ec7fd7792ac03fa",
]
# Their other encodings: y + p where that still fits (y = 0, 1), either sign; x = 0 with the sign set.
NON_CANONICAL = [(v).to_bytes(32, "little").hex() for v in (P, P | SIGN, P + 1, (P + 1) | SIGN, 1 | SIGN, (P - 1) | SIGN)]
IDENTITY_SIGNATURE = bytes.fromhex("01" + "00" * 63)  # R = identity, S = 0


def _encode(point: ed25519.Point) -> bytes:
    x, y, z, _ = point
    zi = pow(z, -1, P)
    x, y = x * zi % P, y * zi % P
    return (y | (x & 1) << 255).to_bytes(32, "little")


class ForgedKey:
    """A "private key" that signs without any secret: the identity signature under a weak key."""

    def __init__(self, public: str):
        self.public = Ed25519PublicKey.from_public_bytes(bytes.fromhex(public))

    def public_key(self) -> Ed25519PublicKey:
        return self.public

    def sign(self, message: bytes) -> bytes:
        return IDENTITY_SIGNATURE


def test_the_forgery_works_against_the_bare_library():
    # the premise: under the identity key, the identity signature verifies for any message
    weak = Ed25519PublicKey.from_public_bytes(bytes.fromhex(SMALL_ORDER[0]))
    for m in (b"a", b"another message", b"\x00" * 100):
        weak.verify(IDENTITY_SIGNATURE, m)


@pytest.mark.parametrize("key", SMALL_ORDER + NON_CANONICAL)
def test_every_small_order_and_non_canonical_key_is_refused(key):
    with pytest.raises(MalformedInput, match="small-order|non-canonical"):
        public_key_from_hex(key)


def test_mixed_order_and_off_curve_keys_are_refused_and_real_keys_pass():
    honest = bytes.fromhex(public_hex(generate_key().public_key()))
    public_key_from_hex(honest.hex())
    # an honest key plus a point of order 2: it is on the curve, not of small order, yet outside the subgroup
    mixed = _encode(ed25519._add(ed25519._decode(honest), ed25519._decode(bytes.fromhex(SMALL_ORDER[1]))))
    with pytest.raises(MalformedInput, match="outside the prime-order subgroup"):
        public_key_from_hex(mixed.hex())
    off = next(bytes([i]) + b"\x00" * 31 for i in range(2, 256) if _off_curve(bytes([i]) + b"\x00" * 31))
    with pytest.raises(MalformedInput, match="not a point on the curve"):
        public_key_from_hex(off.hex())


def _off_curve(raw: bytes) -> bool:
    try:
        ed25519._decode(raw)
    except ValueError:
        return True
    return False


@pytest.mark.parametrize("key", [SMALL_ORDER[0], SMALL_ORDER[2]])
def test_a_bundle_signed_without_a_private_key_is_refused(tmp_path, key):
    bundle = train_tiny(tmp_path / "b", ForgedKey(key), config={"steps": 4}, checkpoint_every=2)
    with pytest.raises(MalformedInput, match="small-order"):
        Verifier(policy=Policy(challenges=1, nonce=b"\x01")).verify(open_bundle(bundle))


def test_the_leaderboard_registers_no_weak_key(tmp_path):
    from fastapi.testclient import TestClient

    from witness.leaderboard.app import create_app

    with TestClient(create_app(make_settings("sqlite", tmp_path))) as tc:
        for i, key in enumerate(SMALL_ORDER + NON_CANONICAL):
            r = tc.post("/api/accounts", json={"name": f"mallory{i}", "public_key": key})
            assert r.status_code == 400 and "public key" in r.json()["detail"], (key, r.text)
        ok = tc.post("/api/accounts", json={"name": "alice", "public_key": public_hex(generate_key().public_key())})
        assert ok.status_code == 201
