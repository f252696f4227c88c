"""drand rounds, checked offline: a chain's pinned information and the BLS signature of one round.

A drand chain (League of Entropy's *quicknet* by default) signs each round number with a threshold
BLS key; the round's randomness is SHA-256 of that signature, so nobody can bias or foresee it and
anyone can check it against the chain's public key. No network here (``witness.beacon.drand`` fetches
rounds), and no torch: the pairing is pyblst's (blst, supranational's BLS12-381 library).
"""

from __future__ import annotations

import functools
import math
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import pyblst

from ..errors import MalformedInput, VerificationError
from .hashing import from_hex, load_json, sha256

# drand's scheme names (drand/drand crypto/schemes.go)
SCHEME_G1_RFC9380 = "bls-unchained-g1-rfc9380"  # quicknet: signatures on G1, key on G2
SCHEME_UNCHAINED = "pedersen-bls-unchained"  # signatures on G2, key on G1
SCHEME_CHAINED = "pedersen-bls-chained"  # the default chain: each round signs the previous signature too
DST_G1 = b"BLS_SIG_BLS12381G1_XMD:SHA-256_SSWU_RO_NUL_"  # RFC 9380 hash to G1, as drand uses it
DST_G2 = b"BLS_SIG_BLS12381G2_XMD:SHA-256_SSWU_RO_NUL_"
DEFAULT_BEACON_ID = "default"  # drand hashes no beacon id into the chain hash for this one (or for "")

# (signature bytes, public key bytes) of the schemes this module verifies
_SIZES = {SCHEME_G1_RFC9380: (48, 96), SCHEME_UNCHAINED: (96, 48)}
_WHY_NOT = {
    SCHEME_CHAINED: "its rounds sign the previous round's signature too, so one round cannot be checked on "
                    "its own; use an unchained chain such as quicknet",
    "bls-unchained-on-g1": "it hashes to G1 with G2's domain tag (not RFC 9380), and drand deprecated it",
}

MAX_ROUND = 1 << 62  # drand's rounds are 64-bit; far beyond any chain's life, refused rather than wrapped
MAX_PERIOD = (1 << 32) - 1  # drand hashes the period as a 32-bit number
MAX_GENESIS = 1 << 40  # seconds since 1970: some 34,000 years
MAX_CHAIN_INFO_BYTES = 16 << 10  # an info JSON is about 500 bytes
MAX_PUBLIC_KEY_BYTES = 256  # of a scheme this module does not verify (a bn254 G2 key is 128)
_TEXT = re.compile(r"[\x21-\x7e]{0,128}")  # a beacon id or scheme name: printable ASCII, no spaces

_G1_GENERATOR = bytes.fromhex("97f1d3a73197d7942695638c4fa9ac0fc3688c4f9774b905a14e3a3f171bac586c55e83ff97a1aeffb"
                              "3af00adb22c6bb")
_G2_GENERATOR = bytes.fromhex("93e02b6052719f607dacd3a088274f65596bd0d09920b61ab5da61bbdc7f5049334cf11213945d57e5"
                              "ac7d055d042b7e024aa2b2f08f0a91260805272dc51051c6e47ad4fa403b02b4510b647ae3d1770bac"
                              "0326a805bbefd48056c8c121bdb8")
_INFINITY = 0x40  # the flag bit of a compressed point at infinity


def chain_hash(public_key: bytes, period: int, genesis_time: int, group_hash: bytes, beacon_id: str) -> bytes:
    """The chain hash exactly as drand computes it (``Info.Hash`` in drand's common/chain/info.go)."""
    # period as uint32 and genesis as int64, big-endian; the beacon id only when not the default one
    # (kept out for backward compatibility with the chain that predates beacon ids); the scheme is not hashed
    tail = b"" if beacon_id in ("", DEFAULT_BEACON_ID) else beacon_id.encode("ascii")
    return sha256(struct.pack(">Iq", period, genesis_time) + public_key + group_hash + tail)


def round_message(round: int) -> bytes:
    """What an unchained drand round signs: SHA-256 of the round number as 8 bytes big-endian."""
    return sha256(round.to_bytes(8, "big"))


@dataclass(frozen=True)
class ChainInfo:
    """A drand chain's public information, as its ``/info`` serves it; its hash is checked on creation."""

    public_key: bytes
    period: int  # seconds between rounds
    genesis_time: int  # when round 1 was due (Unix seconds)
    hash: bytes  # the chain hash: SHA-256 over the fields above, the group hash and the beacon id
    group_hash: bytes
    scheme: str
    beacon_id: str

    def __post_init__(self) -> None:
        for name, kind in (("public_key", bytes), ("hash", bytes), ("group_hash", bytes), ("scheme", str),
                           ("beacon_id", str)):
            if type(getattr(self, name)) is not kind:
                raise MalformedInput(f"drand chain info: {name} must be {kind.__name__}", check="drand")
        for name, top in (("period", MAX_PERIOD), ("genesis_time", MAX_GENESIS)):
            value = getattr(self, name)
            if type(value) is not int or not (1 if name == "period" else 0) <= value <= top:
                raise MalformedInput(f"drand chain info: {name} must be an integer in "
                                     f"[{1 if name == 'period' else 0}, {top}]", check="drand")
        if not _TEXT.fullmatch(self.beacon_id) or not self.scheme or not _TEXT.fullmatch(self.scheme):
            raise MalformedInput("drand chain info: the beacon id and scheme are printable ASCII without spaces, "
                                 "at most 128 characters (the scheme not empty)", check="drand")
        if len(self.hash) != 32 or len(self.group_hash) != 32:
            raise MalformedInput("drand chain info: the chain hash and the group hash are 32 bytes each",
                                 check="drand")
        key_size = _SIZES.get(self.scheme, (0, 0))[1]
        if (key_size and len(self.public_key) != key_size) or not 0 < len(self.public_key) <= MAX_PUBLIC_KEY_BYTES:
            raise MalformedInput(f"drand chain info: a {self.scheme} public key is "
                                 f"{key_size or f'1 to {MAX_PUBLIC_KEY_BYTES}'} bytes, not {len(self.public_key)}",
                                 check="drand")
        computed = self.computed_hash()
        if computed != self.hash:
            raise VerificationError(f"drand chain info: its hash {self.hash.hex()} is not the hash of its fields "
                                    f"({computed.hex()}): the info was altered", check="drand")

    @classmethod
    def build(cls, public_key: bytes, period: int, genesis_time: int, group_hash: bytes, scheme: str,
              beacon_id: str) -> ChainInfo:
        """A chain's info with its hash computed from the other fields."""
        return cls(public_key, period, genesis_time, chain_hash(public_key, period, genesis_time, group_hash,
                                                                beacon_id), group_hash, scheme, beacon_id)

    def computed_hash(self) -> bytes:
        """The chain hash of these fields (drand's ``Info.Hash``)."""
        return chain_hash(self.public_key, self.period, self.genesis_time, self.group_hash, self.beacon_id)

    def name(self) -> str:
        """A short name for messages: the beacon id and the start of the chain hash."""
        return f"drand chain {self.beacon_id or DEFAULT_BEACON_ID} ({self.hash.hex()[:16]}…)"

    def to_json(self) -> dict:
        """The JSON that drand's ``/info`` serves (its v1 form)."""
        return {"public_key": self.public_key.hex(), "period": self.period, "genesis_time": self.genesis_time,
                "hash": self.hash.hex(), "groupHash": self.group_hash.hex(), "schemeID": self.scheme,
                "metadata": {"beaconID": self.beacon_id}}

    @classmethod
    def from_json(cls, obj: object) -> ChainInfo:
        """Strictly parse drand's ``/info`` JSON (its v1 form, or drand 2's field names); check the hash
        and that the public key is a point of the scheme's group."""
        if not isinstance(obj, dict):
            raise MalformedInput("drand chain info is a JSON object", check="drand")
        common = {"public_key", "period", "genesis_time"}
        v1, v2 = common | {"hash", "groupHash", "schemeID", "metadata"}, common | {"chain_hash", "genesis_seed",
                                                                                  "scheme", "beacon_id"}
        if set(obj) == v1:
            meta = obj["metadata"]
            if not isinstance(meta, dict) or not set(meta) <= {"beaconID"} \
                    or not isinstance(meta.get("beaconID", ""), str):
                raise MalformedInput("drand chain info: metadata holds only a beaconID text", check="drand")
            fields = (obj["hash"], obj["groupHash"], obj["schemeID"], meta.get("beaconID", ""))
        elif set(obj) == v2:
            fields = (obj["chain_hash"], obj["genesis_seed"], obj["scheme"], obj["beacon_id"])
        else:
            raise MalformedInput("drand chain info has exactly the fields " + ", ".join(sorted(v1)) + " (or, from "
                                 "drand 2, " + ", ".join(sorted(v2)) + f"); it has {', '.join(sorted(obj))[:300]}",
                                 check="drand")
        hash_hex, group_hex, scheme, beacon_id = fields
        if not isinstance(scheme, str) or not isinstance(beacon_id, str):
            raise MalformedInput("drand chain info: the scheme and the beacon id are texts", check="drand")
        for name in ("period", "genesis_time"):
            if type(obj[name]) is not int:
                raise MalformedInput(f"drand chain info: {name} must be an integer", check="drand")
        key = obj["public_key"]
        if not isinstance(key, str) or not 0 < len(key) <= 2 * MAX_PUBLIC_KEY_BYTES or len(key) % 2:
            raise MalformedInput("drand chain info: public_key must be hex of at most "
                                 f"{MAX_PUBLIC_KEY_BYTES} bytes", check="drand")
        try:
            info = cls(from_hex(key, "public_key", len(key) // 2), obj["period"], obj["genesis_time"],
                       from_hex(hash_hex, "the chain hash"), from_hex(group_hex, "the group hash"), scheme,
                       beacon_id)
        except ValueError as e:
            raise MalformedInput(f"drand chain info: {e}", check="drand") from None
        if info.scheme in _SIZES:
            _public_point(info.scheme, info.public_key)  # a key that is no point is refused here, not per round
        return info


# League of Entropy's quicknet, pinned: drand/drand common/chain/info_test.go (TestJsonFromRelay), and the
# chain drand/tlock's tests time-lock to
QUICKNET = ChainInfo(
    public_key=bytes.fromhex("83cf0f2896adee7eb8b5f01fcad3912212c437e0073e911fb90022d3e760183c8c4b450b6a0a6c3ac6a"
                             "5776a2d1064510d1fec758c921cc22b0e17e63aaf4bcb5ed66304de9cf809bd274ca73bab4af5a6e9c7"
                             "6a4bc09e76eae8991ef5ece45a"),
    period=3,
    genesis_time=1692803367,
    hash=bytes.fromhex("52db9ba70e0cc0f6eaf7803dd07447a1f5477735fd3f661792ba94600c84e971"),
    group_hash=bytes.fromhex("f477d5c89f21a17c863a7f937c6a6d15859414d2be09cd448d4279af331c5d3e"),
    scheme=SCHEME_G1_RFC9380,
    beacon_id="quicknet",
)


def chain_info(spec: str) -> ChainInfo:
    """The chain a ``--drand`` value names: ``quicknet``, or the path of a chain-info JSON file."""
    if spec == "quicknet":
        return QUICKNET
    path = Path(spec)
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_CHAIN_INFO_BYTES + 1)
    except OSError as e:
        raise MalformedInput(f"--drand {spec[:200]}: not quicknet, and no chain-info file can be read there "
                             f"({e.strerror or e})", check="drand") from None
    if len(data) > MAX_CHAIN_INFO_BYTES:
        raise MalformedInput(f"--drand {spec[:200]}: over {MAX_CHAIN_INFO_BYTES} bytes, not a chain-info file",
                             check="drand")
    try:
        obj = load_json(data)
    except ValueError as e:
        raise MalformedInput(f"--drand {spec[:200]}: {e}", check="drand") from None
    return ChainInfo.from_json(obj)


def _check_round(chain: ChainInfo, round: object) -> int:
    if type(round) is not int or not 1 <= round < MAX_ROUND:
        raise MalformedInput(f"{chain.name()}: a round is an integer from 1 to 2^62, not {str(round)[:40]}",
                             check="drand")
    return round


def round_time(chain: ChainInfo, round: int) -> int:
    """When ``round`` is due (Unix seconds): round 1 at genesis, then one every period."""
    return chain.genesis_time + (_check_round(chain, round) - 1) * chain.period


def round_after(chain: ChainInfo, t: float) -> int:
    """The first round due strictly later than ``t`` (Unix seconds)."""
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t):
        raise MalformedInput(f"{chain.name()}: a time is a finite number of seconds, not {str(t)[:40]}",
                             check="drand")
    if t < chain.genesis_time:
        return 1
    r = int((t - chain.genesis_time) // chain.period) + 2
    if r >= MAX_ROUND - 1:
        raise MalformedInput(f"{chain.name()}: the time {t} lies beyond the chain's last round", check="drand")
    # the float division may land one off at an exact multiple of the period: step to the exact answer
    while r > 1 and round_time(chain, r - 1) > t:
        r -= 1
    while round_time(chain, r) <= t:
        r += 1
    return r


def current_round(chain: ChainInfo, t: float) -> int:
    """The latest round due at or before ``t`` (0 before genesis)."""
    return round_after(chain, t) - 1


@functools.lru_cache(maxsize=64)
def _public_point(scheme: str, key: bytes) -> object:
    """A chain's public key as a point of the scheme's key group (checked in the subgroup, not infinity)."""
    group = pyblst.BlstP2Element if scheme == SCHEME_G1_RFC9380 else pyblst.BlstP1Element
    if key[0] & _INFINITY:
        raise VerificationError(f"the {scheme} public key is the point at infinity, which every signature "
                                "would match", check="drand")
    try:
        return group.uncompress(key)
    except ValueError as e:
        raise VerificationError(f"the {scheme} public key {key.hex()[:16]}… is not a point of its group "
                                f"({e})", check="drand") from None


@functools.lru_cache(maxsize=2)
def _generators() -> tuple[object, object]:
    return pyblst.BlstP1Element.uncompress(_G1_GENERATOR), pyblst.BlstP2Element.uncompress(_G2_GENERATOR)


def verify_round(chain: ChainInfo, round: int, signature: bytes) -> bytes:
    """Check ``signature`` is ``chain``'s BLS signature of ``round``; its randomness (SHA-256 of it)."""
    _check_round(chain, round)
    if type(signature) is not bytes:
        raise MalformedInput(f"{chain.name()} round {round}: the signature must be bytes", check="drand")
    sizes = _SIZES.get(chain.scheme)
    if sizes is None:
        why = _WHY_NOT.get(chain.scheme, "this verifier checks bls-unchained-g1-rfc9380 (quicknet) and "
                                         "pedersen-bls-unchained rounds only")
        raise VerificationError(f"{chain.name()}: scheme {chain.scheme} is not supported: {why}", check="drand")
    if len(signature) != sizes[0]:
        raise MalformedInput(f"{chain.name()} round {round}: a {chain.scheme} signature is {sizes[0]} bytes, "
                             f"not {len(signature)}", check="drand")
    # the hash covers the key, and a ChainInfo's hash is checked when it is made: the key names the chain
    return _verified(chain.scheme, chain.public_key, chain.name(), round, signature)


@functools.lru_cache(maxsize=1 << 16)
def _verified(scheme: str, public_key: bytes, name: str, round: int, signature: bytes) -> bytes:
    """The pairing check, once per (chain, round, signature) in a process (an audit's windows share
    rounds); a failure raises, and is not kept."""
    where = f"{name} round {round}"
    if signature[0] & _INFINITY:
        raise VerificationError(f"{where}: the signature is the point at infinity", check="drand")
    key = _public_point(scheme, public_key)
    g1, g2 = _generators()
    message = round_message(round)
    try:
        if scheme == SCHEME_G1_RFC9380:
            sig = pyblst.BlstP1Element.uncompress(signature)
            ok = pyblst.final_verify(pyblst.miller_loop(sig, g2),
                                     pyblst.miller_loop(pyblst.BlstP1Element.hash_to_group(message, DST_G1), key))
        else:
            sig = pyblst.BlstP2Element.uncompress(signature)
            ok = pyblst.final_verify(pyblst.miller_loop(g1, sig),
                                     pyblst.miller_loop(key, pyblst.BlstP2Element.hash_to_group(message, DST_G2)))
    except ValueError as e:  # not a point, or one outside the subgroup
        raise VerificationError(f"{where}: the signature is not a point of its group ({e})", check="drand") from None
    if not ok:
        raise VerificationError(f"{where}: the signature does not verify under the chain's public key",
                                check="drand")
    return sha256(signature)


def randomness(signature: bytes) -> bytes:
    """A round's randomness, as drand derives it: SHA-256 of its signature."""
    return sha256(signature)


# a key pair for a local, drand-compatible endpoint (tests and the demo): never a League of Entropy chain

CURVE_ORDER = 0x73EDA753299D7D483339D80809A1D80553BDA402FFFE5BFEFFFFFFFF00000001


def secret_key(seed: bytes | None = None) -> int:
    """A BLS secret key: from ``seed`` (reproducible), or from the operating system's CSPRNG."""
    material = os.urandom(64) if seed is None else sha256(b"witness/drand-local-key/v1\x00" + seed) \
        + sha256(b"witness/drand-local-key/v1\x01" + seed)
    return int.from_bytes(material, "big") % (CURVE_ORDER - 1) + 1  # 512 bits reduced: no visible bias


def public_key_g2(secret: int) -> bytes:
    """The G2 public key (96 bytes) of a secret key, for signatures on G1."""
    return _generators()[1].scalar_mul(secret).compress()


def sign_round_g1(secret: int, round: int) -> bytes:
    """A bls-unchained-g1-rfc9380 signature (48 bytes) of ``round`` under ``secret``."""
    return pyblst.BlstP1Element.hash_to_group(round_message(round), DST_G1).scalar_mul(secret).compress()
