"""drand rounds checked offline (witness.commit.drand), on real rounds and chain infos taken from drand's
own repositories and its verifiers' (each vector names the file it came from)."""

from __future__ import annotations

import hashlib
import json
import time

import pytest

from witness.commit import drand
from witness.commit.drand import (
    QUICKNET,
    SCHEME_G1_RFC9380,
    SCHEME_UNCHAINED,
    ChainInfo,
    chain_info,
    current_round,
    public_key_g2,
    round_after,
    round_time,
    secret_key,
    sign_round_g1,
    verify_round,
)
from witness.errors import MalformedInput, VerificationError

# drand/drand common/chain/info_test.go (TestJsonFromRelay): quicknet's info, as the relays serve it (v1)
# and as drand 2 writes it
QUICKNET_V1 = json.loads(
    '{"public_key":"83cf0f2896adee7eb8b5f01fcad3912212c437e0073e911fb90022d3e760183c8c4b450b6a0a6c3ac6a5776a2d106451'
    '0d1fec758c921cc22b0e17e63aaf4bcb5ed66304de9cf809bd274ca73bab4af5a6e9c76a4bc09e76eae8991ef5ece45a","period":3,'
    '"genesis_time":1692803367,"hash":"52db9ba70e0cc0f6eaf7803dd07447a1f5477735fd3f661792ba94600c84e971",'
    '"groupHash":"f477d5c89f21a17c863a7f937c6a6d15859414d2be09cd448d4279af331c5d3e",'
    '"schemeID":"bls-unchained-g1-rfc9380","metadata":{"beaconID":"quicknet"}}')
QUICKNET_V2 = json.loads(
    '{"public_key":"83cf0f2896adee7eb8b5f01fcad3912212c437e0073e911fb90022d3e760183c8c4b450b6a0a6c3ac6a5776a2d106451'
    '0d1fec758c921cc22b0e17e63aaf4bcb5ed66304de9cf809bd274ca73bab4af5a6e9c76a4bc09e76eae8991ef5ece45a","period":3,'
    '"genesis_time":1692803367,"genesis_seed":"f477d5c89f21a17c863a7f937c6a6d15859414d2be09cd448d4279af331c5d3e",'
    '"chain_hash":"52db9ba70e0cc0f6eaf7803dd07447a1f5477735fd3f661792ba94600c84e971",'
    '"scheme":"bls-unchained-g1-rfc9380","beacon_id":"quicknet"}')
# drand/tlock networks/fixed/fixed_test.go (TestFromInfo): the default (chained, 30 s) chain and evmnet
DEFAULT_V2 = json.loads(
    '{"public_key":"868f005eb8e6e4ca0a47c8a77ceaa5309a47978a7c71bc5cce96366b5d7a569937c529eeda66c7293784a9402801af31",'
    '"period":30,"genesis_time":1595431050,"genesis_seed":"176f93498eac9ca337150b46d21dd58673ea4e3581185f869672e59fa4cb'
    '390a","chain_hash":"8990e7a9aaed2ffed73dbd7092123d6f289930540d7651336225dc172e51b2ce",'
    '"scheme":"pedersen-bls-chained","beacon_id":"default"}')
EVMNET_V2 = json.loads(
    '{"public_key":"07e1d1d335df83fa98462005690372c643340060d205306a9aa8106b6bd0b3820557ec32c2ad488e4d4f6008f89a346f18'
    '492092ccc0d594610de2732c8b808f0095685ae3a85ba243747b1b2f426049010f6b73a0cf1d389351d5aaaa1047f6297d3a4f9749b33eb2d9'
    '04c9d9ebf17224150ddd7abd7567a9bec6c74480ee0b","period":3,"genesis_time":1727521075,"genesis_seed":"cd7ad2f0e0cce5'
    'd8c288f2dd016ffe7bc8dc88dbb229b3da2b6ad736490dfed6","chain_hash":"04f1e9062b8a81f848fded9c12306733282b2727ecced500'
    '32187751166ec8c3","scheme":"bls-bn254-unchained-on-g1","beacon_id":"evmnet"}')
# drand/tlock tlock_test.go (TestDecryptText, "With quicknet-t invalid network"): quicknet's testnet twin
QUICKNET_T_V2 = json.loads(
    '{"public_key":"b15b65b46fb29104f6a4b5d1e11a8da6344463973d423661bb0804846a0ecd1ef93c25057f1c0baab2ac53e56c662b6607'
    '2f6d84ee791a3382bfb055afab1e6a375538d8ffc451104ac971d2dc9b168e2d3246b0be2015969cbaac298f6502da","period":3,'
    '"genesis_time":1689232296,"genesis_seed":"40d49d910472d4adb1d67f65db8332f11b4284eecf05c05c5eacd5eef7d40e2d",'
    '"chain_hash":"cc9c398442737cbd141526600919edd69f1d6f9b4adb67e4d912fbc64341a9a5","scheme":"bls-unchained-g1-rfc9380",'
    '"beacon_id":"quicknet-t"}')

# quicknet rounds: (round, signature, randomness where the source publishes it)
QUICKNET_ROUNDS = [
    # noislabs/drand-verify src/verify.rs (verify_works_for_g1g2_swapped_rfc)
    (123, "b75c69d0b72a5d906e854e808ba7e2accb1542ac355ae486d591aa9d43765482e26cd02df835d3546d23c4b13e0dfc92", None),
    # drand/tlock tlock_test.go (TestDecryptText, TestDeterministicTimeLock)
    (12040883, "929906c959032ab363c9f26570d215d66f5c06cb0c44fe508c12bb5839f04ec895bb6868e5b9ff13ab289bdb5266b394",
     None),
    # very-lame-username/python-drand-verify README.md (verify_quicknet, with the randomness it returns)
    (657413, "b713718a38ae728dfd477991af2822e08d2f305e47718cef9f7848ce4050e7be41076862b98fad56e91a6b85b89cd97b",
     "fc1873a13f3545aeade8401532ef5519920652eee6b0d2b19ca12643b87b3587"),
]
SIG_123 = bytes.fromhex(QUICKNET_ROUNDS[0][1])
SIG_12040883 = bytes.fromhex(QUICKNET_ROUNDS[1][1])

# noislabs/drand-verify src/verify.rs (verify_works_for_g1g2_swapped_rfc): another bls-unchained-g1-rfc9380
# key (a local drand network's), with its rounds 3, 4 and 6
OTHER_G1_KEY = bytes.fromhex("a1ee12542360bf75742bcade13d6134e7d5283d9eb782887c47d3d9725f05805d37b0106b7f744395bf82c1"
                             "75dd7434a169e998f188a657a030d588892c0cd2c01f996aaf331c4d8bc5b9734bbe261d09e7d2d39ef88b63"
                             "5077f262bd7bbb30f")
OTHER_G1_ROUNDS = {3: "b98dae74f6a9d2ec79d75ba273dcfda86a45d589412860eb4c0fd056b00654dbf667c1b6884987c9aee0d43f8ba9db52",
                   4: "962c2b2969e8f3351cf5cc457b04ecbf0c65bd79f4c1ee3bd0205f581368aaaa0cdeb1531a0709d39ef06a8ba1e1bb93",
                   6: "a054dafb27a4a4fb9e06b17b30da3e0c7b13b4ca8e1dec3c6775f81758587029aa358523f2e7e62204018347db7cbd1c"}
# noislabs/drand-verify src/verify.rs (verify_works_for_unchained): a pedersen-bls-unchained testnet's key,
# its round 223344, and its round 1 (a valid point, of another round)
UNCHAINED_KEY = bytes.fromhex("8200fc249deb0148eb918d6e213980c5d01acd7fc251900d9260136da3b54836ce125172399ddc69c4e3e11"
                              "429b62c11")
UNCHAINED_223344 = bytes.fromhex("94f6b85df7cce7237e8e7df66d794ddad092de5d8bb6a791b97e905aa89852e506ac36a792eba7021e2"
                                 "2eebf34891f8914bf9a8dd9233ea0a4c5ca00ef8404999f899073dd2eade61fe54077fee8168f83dcb6"
                                 "1a758b6883b38904054e64a433")
UNCHAINED_1 = bytes.fromhex("86ecea71376e78abd19aaf0ad52f462a6483626563b1023bd04815a7b953da888c74f5bf6ee672a5688603ab31"
                            "0026230522898f33f23a7de363c66f90ffd49ec77ebf7f6c1478a9ecd6e714b4d532ab43d044da0a16fed13b47"
                            "91d7fc999e2b")
# noislabs/drand-verify src/randomness.rs (derives_randomness_correctly): default-chain rounds 72785 and 1337
DEFAULT_RANDOMNESS = [
    ("82f5d3d2de4db19d40a6980e8aa37842a0e55d1df06bd68bddc8d60002e8e959eb9cfa368b3c1b77d18f02a54fe047b80f0989315f83b12a"
     "74fd8679c4f12aae86eaf6ab5690b34f1fddd50ee3cc6f6cdf59e95526d5a5d82aaa84fa6f181e42",
     "8b676484b5fb1f37f9ec5c413d7d29883504e5b669f604a1ce68b3388e9ae3d9"),
    ("945b08dcb30e24da281ccf14a646f0630ceec515af5c5895e18cc1b19edd65d156b71c776a369af3487f1bc6af1062500b059e01095cc0ee"
     "dce91713977d7735cac675554edfa0d0481bb991ed93d333d08286192c05bf6b65d20f23a37fc7bb",
     "2660664f8d4bc401194d80d81da20a1e79480f65b8e2d205aecbd143b5bfb0d3"),
]


def other_chain(key: bytes, scheme: str = SCHEME_G1_RFC9380, beacon_id: str = "other") -> ChainInfo:
    """A chain of ``key`` (its period, genesis and group hash made up: only the key matters to a signature)."""
    return ChainInfo.build(key, 3, 1692803367, b"\x11" * 32, scheme, beacon_id)


def test_quicknet_is_the_chain_drand_publishes():
    assert ChainInfo.from_json(QUICKNET_V1) == QUICKNET
    assert ChainInfo.from_json(QUICKNET_V2) == QUICKNET
    assert QUICKNET.to_json() == QUICKNET_V1
    assert QUICKNET.computed_hash().hex() == "52db9ba70e0cc0f6eaf7803dd07447a1f5477735fd3f661792ba94600c84e971"
    assert QUICKNET.public_key.hex().startswith("83cf0f2896adee7eb8b5f01fcad3912212c437e0073e911fb90022d3e760183c")
    assert (QUICKNET.period, QUICKNET.genesis_time, QUICKNET.scheme, QUICKNET.beacon_id) == \
        (3, 1692803367, "bls-unchained-g1-rfc9380", "quicknet")


@pytest.mark.parametrize("info", [DEFAULT_V2, EVMNET_V2, QUICKNET_T_V2], ids=["default", "evmnet", "quicknet-t"])
def test_chain_hash_is_drands(info):
    parsed = ChainInfo.from_json(info)
    assert parsed.hash.hex() == info["chain_hash"] == parsed.computed_hash().hex()
    assert ChainInfo.from_json(parsed.to_json()) == parsed  # the v1 form says the same


def test_default_chain_hashes_no_beacon_id():
    # drand hashes the beacon id of every chain but the default one (kept so, for backward compatibility)
    default = ChainInfo.from_json(DEFAULT_V2)
    assert drand.chain_hash(default.public_key, 30, 1595431050, default.group_hash, "").hex() == \
        "8990e7a9aaed2ffed73dbd7092123d6f289930540d7651336225dc172e51b2ce"
    assert drand.chain_hash(QUICKNET.public_key, 3, 1692803367, QUICKNET.group_hash, "default") != QUICKNET.hash


@pytest.mark.parametrize("field,value", [
    ("period", 30), ("genesis_time", 1692803368), ("groupHash", "00" * 32), ("metadata", {"beaconID": "quicknet-t"}),
    ("metadata", {"beaconID": "default"}), ("public_key", QUICKNET_T_V2["public_key"]), ("hash", "00" * 32),
])
def test_altered_info_is_refused(field, value):
    with pytest.raises(VerificationError, match="altered") as e:
        ChainInfo.from_json({**QUICKNET_V1, field: value})
    assert e.value.check == "drand" and not isinstance(e.value, MalformedInput)


def test_scheme_is_not_hashed_but_must_fit_the_key():
    # drand's chain hash leaves the scheme out: another scheme with quicknet's 96-byte key is refused by
    # the key's size (pedersen keys are 48 bytes on G1), not by the hash
    with pytest.raises(MalformedInput, match="public key is 48 bytes, not 96"):
        ChainInfo.from_json({**QUICKNET_V1, "schemeID": SCHEME_UNCHAINED})


@pytest.mark.parametrize("change", [
    {"extra": 1}, {"period": "3"}, {"period": 3.0}, {"period": True}, {"period": 0}, {"period": 1 << 32},
    {"genesis_time": -1}, {"public_key": QUICKNET_V1["public_key"].upper()}, {"public_key": "83cf"},
    {"public_key": 5}, {"hash": QUICKNET_V1["hash"][:-2]}, {"groupHash": None}, {"schemeID": ""},
    {"schemeID": "bls unchained"}, {"metadata": {"beaconID": "quicknet", "chain_hash": "00"}},
    {"metadata": {"beaconID": 7}}, {"metadata": "quicknet"}, {"beacon_id": "quicknet"},
])
def test_info_is_parsed_strictly(change):
    with pytest.raises(MalformedInput):
        ChainInfo.from_json({**QUICKNET_V1, **change})


def test_info_has_every_field_of_one_form():
    for missing in QUICKNET_V1:
        with pytest.raises(MalformedInput, match="exactly the fields"):
            ChainInfo.from_json({k: v for k, v in QUICKNET_V1.items() if k != missing})
    with pytest.raises(MalformedInput, match="exactly the fields"):  # v1 and v2 names mixed
        ChainInfo.from_json({**QUICKNET_V1, "chain_hash": QUICKNET_V1["hash"]})
    with pytest.raises(MalformedInput, match="a JSON object"):
        ChainInfo.from_json([QUICKNET_V1])


def test_a_key_that_is_no_point_is_refused():
    not_a_point = bytes([QUICKNET.public_key[0]]) + b"\x41" * 7 + QUICKNET.public_key[8:]
    infinity = bytes([0xc0]) + bytes(95)
    for key in (not_a_point, infinity):
        forged = ChainInfo.build(key, 3, 1692803367, QUICKNET.group_hash, SCHEME_G1_RFC9380, "quicknet")
        with pytest.raises(VerificationError, match="not a point|infinity"):
            ChainInfo.from_json(forged.to_json())
        with pytest.raises(VerificationError, match="not a point|infinity"):
            verify_round(forged, 123, SIG_123)


@pytest.mark.parametrize("round,signature,published", QUICKNET_ROUNDS)
def test_quicknet_rounds_verify(round, signature, published):
    sig = bytes.fromhex(signature)
    randomness = verify_round(QUICKNET, round, sig)
    assert randomness == hashlib.sha256(sig).digest() == drand.randomness(sig)
    if published:
        assert randomness.hex() == published


@pytest.mark.parametrize("signature,published", DEFAULT_RANDOMNESS)
def test_randomness_is_sha256_of_the_signature(signature, published):
    assert drand.randomness(bytes.fromhex(signature)).hex() == published


@pytest.mark.parametrize("round", [122, 124, 12040883, 1])
def test_a_signature_of_another_round_is_refused(round):
    with pytest.raises(VerificationError, match=f"drand chain quicknet .* round {round}: the signature does not verify"):
        verify_round(QUICKNET, round, SIG_123)
    with pytest.raises(VerificationError, match="does not verify"):
        verify_round(QUICKNET, 123, SIG_12040883)


@pytest.mark.parametrize("position", [0, 1, 10, 24, 47])
def test_a_flipped_signature_byte_is_refused(position):
    for bit in (0x01, 0x80):
        tampered = bytearray(SIG_123)
        tampered[position] ^= bit
        with pytest.raises(VerificationError, match="round 123"):
            verify_round(QUICKNET, 123, bytes(tampered))


def test_the_same_signature_under_another_chain_is_refused():
    other = other_chain(OTHER_G1_KEY)
    for round, signature in OTHER_G1_ROUNDS.items():  # that chain's own rounds verify under its key...
        verify_round(other, round, bytes.fromhex(signature))
        with pytest.raises(VerificationError, match="drand chain quicknet"):  # ...and under quicknet's not
            verify_round(QUICKNET, round, bytes.fromhex(signature))
    with pytest.raises(VerificationError, match="drand chain other .* round 123"):
        verify_round(other, 123, SIG_123)
    # quicknet's testnet twin: same scheme and period, another key
    with pytest.raises(VerificationError, match="does not verify"):
        verify_round(ChainInfo.from_json(QUICKNET_T_V2), 12040883, SIG_12040883)


def test_a_locally_generated_key_signs_rounds_quicknet_refuses():
    secret = secret_key(b"test seed")
    assert secret == secret_key(b"test seed") != secret_key(b"other seed") and secret != secret_key()
    local = other_chain(public_key_g2(secret), beacon_id="witness-local")
    sig = sign_round_g1(secret, 123)
    assert len(sig) == 48 and verify_round(local, 123, sig) == hashlib.sha256(sig).digest()
    with pytest.raises(VerificationError, match="round 124"):
        verify_round(local, 124, sig)
    with pytest.raises(VerificationError, match="drand chain quicknet"):
        verify_round(QUICKNET, 123, sig)
    with pytest.raises(VerificationError, match="witness-local"):
        verify_round(local, 123, SIG_123)


def test_pedersen_bls_unchained_rounds():
    chain = other_chain(UNCHAINED_KEY, SCHEME_UNCHAINED, "unchained-testnet")
    assert verify_round(chain, 223344, UNCHAINED_223344) == hashlib.sha256(UNCHAINED_223344).digest()
    for round, sig in ((223343, UNCHAINED_223344), (223344, UNCHAINED_1)):
        with pytest.raises(VerificationError, match=f"round {round}: the signature does not verify"):
            verify_round(chain, round, sig)
    with pytest.raises(MalformedInput, match="signature is 96 bytes, not 48"):
        verify_round(chain, 123, SIG_123)


@pytest.mark.parametrize("info", [DEFAULT_V2, EVMNET_V2], ids=["chained", "bn254"])
def test_other_schemes_are_refused_clearly(info):
    chain = ChainInfo.from_json(info)
    with pytest.raises(VerificationError, match=f"scheme {info['scheme']} is not supported: "):
        # drand-verify src/verify.rs (verify_works): default-chain round 72785
        verify_round(chain, 72785, bytes.fromhex(DEFAULT_RANDOMNESS[0][0]))


def _off_subgroup_g1_point() -> bytes:
    """A compressed point on BLS12-381's G1 curve outside its prime-order subgroup (x = 5 is one)."""
    q = 0x1A0111EA397FE69A4B1BA7B6434BACD764774B84F38512BF6730D2A0F6B0F6241EABFFFEB153FFFFB9FEFFFFFFFFAAAB
    x = 5
    y = pow((x ** 3 + 4) % q, (q + 1) // 4, q)
    assert y * y % q == (x ** 3 + 4) % q
    flags = 0x80 | (0x20 if y > (q - 1) // 2 else 0)
    raw = bytearray(x.to_bytes(48, "big"))
    raw[0] |= flags
    return bytes(raw)


@pytest.mark.parametrize("signature,error,message", [
    (SIG_123[:47], MalformedInput, "48 bytes, not 47"), (SIG_123 + b"\x00", MalformedInput, "48 bytes, not 49"),
    (b"", MalformedInput, "not 0"), (SIG_123 * 2, MalformedInput, "not 96"),
    (SIG_123.hex(), MalformedInput, "must be bytes"), (bytearray(SIG_123), MalformedInput, "must be bytes"),
    (bytes([0xc0]) + bytes(47), VerificationError, "point at infinity"),
    (bytes(48), VerificationError, "not a point"), (_off_subgroup_g1_point(), VerificationError, "not a point"),
])
def test_malformed_signatures_are_refused(signature, error, message):
    with pytest.raises(error, match=message) as e:
        verify_round(QUICKNET, 123, signature)
    assert e.value.check == "drand"


@pytest.mark.parametrize("round", [0, -1, 1 << 62, 1 << 64, 123.0, True, "123", None])
def test_bad_round_numbers_are_refused(round):
    with pytest.raises(MalformedInput, match="a round is an integer"):
        verify_round(QUICKNET, round, SIG_123)
    with pytest.raises(MalformedInput, match="a round is an integer"):
        round_time(QUICKNET, round)


def test_round_times():
    # drand/tlock networks/fixed/fixed_test.go: quicknet's round at its genesis time is round 1
    assert round_time(QUICKNET, 1) == 1692803367
    assert current_round(QUICKNET, 1692803367) == 1
    assert round_time(QUICKNET, 12040883) == 1692803367 + 12040882 * 3
    assert round_after(QUICKNET, 0) == 1 and current_round(QUICKNET, 0) == 0
    assert round_after(QUICKNET, 1692803366.999) == 1
    assert round_after(QUICKNET, 1692803367) == 2  # strictly later: round 1 is due at that very time
    assert round_after(QUICKNET, 1692803369.999) == 2
    assert round_after(QUICKNET, 1692803370) == 3
    for t in (1692803367 + 0.5, 1700000000.25, time.time()):
        r = round_after(QUICKNET, t)
        assert round_time(QUICKNET, r - 1) <= t < round_time(QUICKNET, r)
    for t in range(1692803367 + 36_000_000, 1692803367 + 36_000_000 + 9):  # exact multiples and between
        r = round_after(QUICKNET, float(t))
        assert round_time(QUICKNET, r - 1) <= t < round_time(QUICKNET, r)
    for bad in (float("nan"), float("inf"), True, "1692803367", 1e300):
        with pytest.raises(MalformedInput):
            round_after(QUICKNET, bad)


def test_chain_info_spec(tmp_path):
    assert chain_info("quicknet") is QUICKNET
    path = tmp_path / "chain.json"
    path.write_text(json.dumps(QUICKNET_T_V2))
    assert chain_info(str(path)) == ChainInfo.from_json(QUICKNET_T_V2)
    with pytest.raises(MalformedInput, match="not quicknet, and no chain-info file"):
        chain_info(str(tmp_path / "missing.json"))
    with pytest.raises(MalformedInput, match="not quicknet"):
        chain_info("Quicknet")
    path.write_text(json.dumps(QUICKNET_T_V2) + " " * drand.MAX_CHAIN_INFO_BYTES)
    with pytest.raises(MalformedInput, match="over 16384 bytes"):
        chain_info(str(path))
    path.write_text("{not json")
    with pytest.raises(MalformedInput, match="not valid JSON"):
        chain_info(str(path))
    path.write_text(json.dumps({**QUICKNET_V1, "period": 30}))
    with pytest.raises(VerificationError, match="altered"):
        chain_info(str(path))


def test_each_round_is_verified_once():
    drand._verified.cache_clear()
    verify_round(QUICKNET, 123, SIG_123)
    for _ in range(100):
        assert verify_round(QUICKNET, 123, SIG_123) == hashlib.sha256(SIG_123).digest()
    info = drand._verified.cache_info()
    assert (info.misses, info.hits) == (1, 100)
    for _ in range(2):  # a refusal is not remembered as anything: it is refused again
        with pytest.raises(VerificationError):
            verify_round(QUICKNET, 124, SIG_123)
    # the cache is per chain: the same round and signature under another key is checked again, and refused
    with pytest.raises(VerificationError):
        verify_round(other_chain(OTHER_G1_KEY), 123, SIG_123)


def test_chain_info_is_checked_when_made():
    with pytest.raises(VerificationError, match="altered"):
        ChainInfo(QUICKNET.public_key, 3, 1692803367, b"\x00" * 32, QUICKNET.group_hash, SCHEME_G1_RFC9380, "quicknet")
    with pytest.raises(MalformedInput, match="period"):
        ChainInfo.build(QUICKNET.public_key, 0, 1692803367, QUICKNET.group_hash, SCHEME_G1_RFC9380, "quicknet")
