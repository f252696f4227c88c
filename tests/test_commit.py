"""Canonical JSON, Ed25519 signed tree heads and the run log."""

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from witness.commit.hashing import canonical_json, parse_canonical_json, tagged_hash
from witness.commit.log import RunLog
from witness.commit.signing import (
    SignedTreeHead,
    generate_key,
    load_key,
    parse_public_key,
    public_hex,
    public_key_from_hex,
    public_pem,
    read_public_key,
    save_key,
)
from witness.errors import MalformedInput, VerificationError


def test_rfc8032_ed25519_vector_verifies_through_our_key_parser():
    # RFC 8032 §7.1, TEST 1 (empty message).
    secret = bytes.fromhex("9d61b19deffd5a60ba844af492ec2cc44449c5697b326919703bac031cae7f60")
    public = "d75a980182b10ab7d54bfed3c964073a0ee172f3daa62325af021a68f707511a"
    sig = bytes.fromhex(
        "e5564300c360ac729086e2cc806e828a84877f1eb8e5d974d873e065224901555fb8821590a33bacc61e39701cf9b46bd25bf5f0595bbe24655141438e7a100b"
    )
    key = Ed25519PrivateKey.from_private_bytes(secret)
    assert public_hex(key.public_key()) == public
    assert key.sign(b"") == sig
    public_key_from_hex(public).verify(sig, b"")


def test_canonical_json_round_trip_and_strictness():
    obj = {"b": [1, 2.5, "x"], "a": {"z": None, "y": True}}
    data = canonical_json(obj)
    assert data == b'{"a":{"y":true,"z":null},"b":[1,2.5,"x"]}'
    assert parse_canonical_json(data) == obj
    for bad in [b'{"a": 1}', b'{"b":1,"a":2}', b'{"a":1,"a":1}', b"[NaN]", b'{"a":1', b"\xff"]:
        with pytest.raises(ValueError):
            parse_canonical_json(bad)
    assert canonical_json([float("nan"), float("inf")]) == b'["nan","inf"]'


def test_tagged_hash_separates_parts():
    assert tagged_hash("t", b"ab", b"c") != tagged_hash("t", b"a", b"bc")
    assert tagged_hash("t", b"x") != tagged_hash("u", b"x")


def test_key_round_trip(tmp_path):
    key = generate_key()
    pub = save_key(key, tmp_path / "k.pem")
    assert (tmp_path / "k.pem").stat().st_mode & 0o777 == 0o600
    assert pub.read_text().strip() == public_hex(key.public_key())
    assert public_hex(load_key(tmp_path / "k.pem").public_key()) == public_hex(key.public_key())


# RFC 8410 §10.1: the example Ed25519 public key in SubjectPublicKeyInfo PEM, and its raw bytes.
RFC8410_PEM = """-----BEGIN PUBLIC KEY-----
MCowBQYDK2VwAyEAGb9ECWmEzf6FQbrBZ9w7lshQhqowtrbLDFw4rXAxZuE=
-----END PUBLIC KEY-----
"""
RFC8410_RAW = "19bf44096984cdfe8541bac167dc3b96c85086aa30b6b6cb0c5c38ad703166e1"


def test_public_keys_are_written_as_hex_and_pem_and_both_are_read(tmp_path):
    assert parse_public_key(RFC8410_PEM) == RFC8410_RAW
    assert public_pem(public_key_from_hex(RFC8410_RAW)) == RFC8410_PEM
    key = generate_key()
    raw = public_hex(key.public_key())
    pub = save_key(key, tmp_path / "k.pem")
    pem_file = tmp_path / "k.pub.pem"
    assert pem_file.read_text().startswith("-----BEGIN PUBLIC KEY-----")
    # every form names the same key: hex, PEM, upper-case hex, and files holding them
    for form in (raw, raw.upper(), pem_file.read_text(), str(pub), str(pem_file)):
        assert read_public_key(form) == raw, form


@pytest.mark.parametrize("bad, why", [
    ("-----BEGIN PUBLIC KEY-----\nnot base64\n-----END PUBLIC KEY-----\n", "unreadable PEM"),
    (public_pem(Ed25519PrivateKey.generate().public_key()).replace("A", "B", 3), "bad public key"),
    ("00" * 31, "bad public key"),
    ("-----BEGIN PUBLIC KEY-----\n" + "A" * 5000 + "\n-----END PUBLIC KEY-----\n", "sensible length"),
])
def test_a_malformed_public_key_in_any_form_is_refused(bad, why):
    with pytest.raises(MalformedInput, match=why):
        parse_public_key(bad)


def test_a_weak_key_is_refused_in_pem_form_too():
    import base64

    # the identity point (small order) wrapped as SubjectPublicKeyInfo
    der = bytes.fromhex("302a300506032b6570032100") + (1).to_bytes(32, "little")
    pem = "-----BEGIN PUBLIC KEY-----\n" + base64.b64encode(der).decode() + "\n-----END PUBLIC KEY-----\n"
    with pytest.raises(MalformedInput, match="small-order"):
        parse_public_key(pem)
    # a well-formed PEM key of another algorithm
    x = X25519PrivateKey.generate().public_key().public_bytes(serialization.Encoding.PEM,
                                                               serialization.PublicFormat.SubjectPublicKeyInfo)
    with pytest.raises(MalformedInput, match="another kind"):
        parse_public_key(x.decode())


def test_signed_tree_head_rejects_any_change():
    key = generate_key()
    log = RunLog()
    for i in range(5):
        log.append({"i": i})
    head = log.sign_head(key)
    head.verify(key.public_key())
    again = SignedTreeHead.from_json(head.to_json())
    again.verify(key.public_key())
    for changed in [
        SignedTreeHead(head.size + 1, head.root, head.timestamp_ms, head.signature),
        SignedTreeHead(head.size, log.root(4), head.timestamp_ms, head.signature),
        SignedTreeHead(head.size, head.root, head.timestamp_ms + 1, head.signature),
    ]:
        with pytest.raises(VerificationError, match="signature"):
            changed.verify(key.public_key())
    other: Ed25519PublicKey = generate_key().public_key()
    with pytest.raises(VerificationError):
        head.verify(other)
    bad = head.to_json() | {"extra": 1}
    with pytest.raises(MalformedInput):
        SignedTreeHead.from_json(bad)
