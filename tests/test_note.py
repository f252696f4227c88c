"""C2SP signed notes, checkpoints and cosignatures against other implementations' published vectors,
and the strictness of every parser."""

from __future__ import annotations

import base64
import hashlib

import pytest

from witness.commit.cosignature import (
    cosign,
    cosignature_message,
    cosignature_timestamp,
    verify_cosignature,
)
from witness.commit.note import (
    COSIGNATURE_V1,
    ED25519,
    Checkpoint,
    Note,
    NoteKey,
    NoteSignature,
    is_run_origin,
    key_id,
    origin_hash,
    parse_note,
    parse_signer_key,
    run_origin,
    sign_note,
    verify_note_signature,
)
from witness.commit.signing import generate_key
from witness.errors import MalformedInput, VerificationError

# --- golang.org/x/mod, sumdb/note/note_test.go ------------------------------------------------
PETER_VKEY = "PeterNeumann+c74f20a3+ARpc2QcUPDhMQegwxbzhKqiBfsVkmqq/LDE4izWy10TW"
PETER_SKEY = "PRIVATE+KEY+PeterNeumann+c74f20a3+AYEKFALVFGyNhPJEMzD1QIDr+Y7hfZx09iUvxdXHKDFz"
ENOCH_VKEY = "EnochRoot+af0cfe78+ATtqJ7zOtqQtYqOo0CpvDXNlMhV3HeJDpjrASKGLWdop"
TEXT = "If you think cryptography is the answer to your problem,\nthen you don't know what your problem is.\n"
PETER_SIG = ("— PeterNeumann x08go/ZJkuBS9UG/SffcvIAQxVBtiFupLLr8pAcElZInNIuGUgYN1FFYC2pZSNXgKvqfqdngotpRZb6KE6Ryy"
             "BwJnAM=\n")
ENOCH_SIG = ("— EnochRoot rwz+eBzmZa0SO3NbfRGzPCpDckykFXSdeX+MNtCOXm2/5n2tiOHp+vAF1aGrQ5ovTG01oOTGwnWLox33WWd1RvMc"
             "+QQ=\n")

# --- C2SP, signed-note.md (the verifier key example) -------------------------------------------
C2SP_VKEY = "example.com/foo+530d903a+AekyeRrm56hApGFkyQR4ZCbV54Id2LKaANYcrnKv3U2k"
C2SP_NOTE = ("This is an example message.\n\n— example.com/foo Uw2QOkn8srV1yJGh2VYRlL1Tnagv1YEq6TfXppzi2ONncAlTgK7Ztg1"
             "ERYNZXsYjOBH3mFXmRKuwHjG1Yu72IneyaQM=\n")

# --- C2SP, tlog-checkpoint.md and tlog-cosignature.md (no keys published: structure only) -------
SOFA = "example.com/behind-the-sofa\n20852163\nCsUYapGGPo4dkMgIAUqom/Xajj7h2fB2MPA3j2jxq2I=\n"
SOFA_NOTE = (SOFA + "\n— example.com/behind-the-sofa Az3grlgtzPICa5OS8npVmf1Myq/5IZniMp+ZJurmRDeOoRDe4URYN7u5/Zhcyv2q1gG"
             "zGku9nTo+zyWE+xeMcTOAYQ8=\n— witness.example.com/w1 jWbPPwAAAABkGFDLEZMHwSRaJNiIDoe9DYn/zXcrtPHeolMI5OW"
             "XEhZCB9dlrDJsX3b2oyin1nPZqhf5nNo0xUe+mbIUBkBIfZ+qnA==\n")
SOFA_COSIGNED_MESSAGE = ("cosignature/v1\ntime 1679315147\nexample.com/behind-the-sofa\n20852163\n"
                         "CsUYapGGPo4dkMgIAUqom/Xajj7h2fB2MPA3j2jxq2I=\n")

# --- transparency-dev/formats, note/note_cosigv1_test.go ---------------------------------------
REMORA_VKEY = "remora.n621.de+da77ade7+BOvN63jn/bLvkieywe8R6UYAtVtNbZpXh34x7onlmtw2"  # a cosigner key, type 0x04
TEST_VKEY = "TEST+7997405c+AQcC+FTVKf0jlTdHDY3rbevmnKxxPjigCXlVtGe6RIr6"  # a note key whose base64 holds "+"
COSIG_1727964367 = "ZGhGuQAAAABm/qTPeyKXD+R2rzyQsxPiP8mXum7qq/iF0u4vanlqJyocWODBt97w9uL+8qT7S5gxEHWWOworDcFiEBYJXORmnFBOBA=="
NOT_COSIG = "eQjRQm6eSKzFoiYalgwCPXu2y3ijtg68is9M46JKxuZB+dRfTmeQeDBoXnvxZx2ugnkyV+MUMLXpWs1hPb/W/4xkNQY="


def test_go_vkey_parses_and_its_id_is_the_key_id_of_its_key():
    k = NoteKey.parse(PETER_VKEY)
    assert (k.name, k.alg, k.id.hex()) == ("PeterNeumann", ED25519, "c74f20a3")
    assert key_id("PeterNeumann", ED25519, k.public).hex() == "c74f20a3"
    assert k.vkey() == PETER_VKEY and NoteKey.parse(ENOCH_VKEY).id.hex() == "af0cfe78"


def test_every_mangling_of_go_vkey_is_refused():
    # as note_test.go's TestNewVerifier: every proper substring, and every byte moved by one
    b = PETER_VKEY
    for i in range(len(b) + 1):
        for j in range(i + 1, len(b) + 1):
            if (i, j) != (0, len(b)):
                with pytest.raises(MalformedInput):
                    NoteKey.parse(b[i:j])
    for i in range(len(b)):
        with pytest.raises(MalformedInput):
            NoteKey.parse(b[:i] + chr(ord(b[i]) + 1) + b[i + 1:])
    # a wrong-length key and an unknown algorithm, each with its key hash adjusted (note_test.go)
    for bad in ("PeterNeumann+cc469956+ARpc2QcUPDhMQegwxbzhKqiBfsVkmqq/LDE4izWy10TWBADKEY==",
                "PeterNeumann+173116ae+ZRpc2QcUPDhMQegwxbzhKqiBfsVkmqq/LDE4izWy10TW"):
        with pytest.raises(MalformedInput):
            NoteKey.parse(bad)


def test_every_mangling_of_go_signer_key_is_refused():
    name, key = parse_signer_key(PETER_SKEY)
    assert name == "PeterNeumann" and NoteKey.of(name, key.public_key()).vkey() == PETER_VKEY
    b = PETER_SKEY
    for i in range(len(b) + 1):
        for j in range(i + 1, len(b) + 1):
            if (i, j) != (0, len(b)):
                with pytest.raises(MalformedInput):
                    parse_signer_key(b[i:j])
    for i in range(len(b)):
        with pytest.raises(MalformedInput):
            parse_signer_key(b[:i] + chr(ord(b[i]) + 1) + b[i + 1:])


def test_our_signature_with_go_private_key_is_theirs_byte_for_byte():
    name, key = parse_signer_key(PETER_SKEY)
    sig = sign_note(TEXT, name, key)
    assert sig.line() == PETER_SIG  # Ed25519 is deterministic
    assert Note(TEXT, (sig,)).encode().decode() == TEXT + "\n" + PETER_SIG  # note_test.go's TestSign `want`


def test_go_notes_open_as_note_test_go_opens_them():
    peter, enoch = NoteKey.parse(PETER_VKEY), NoteKey.parse(ENOCH_VKEY)
    note = parse_note((TEXT + "\n" + PETER_SIG + ENOCH_SIG).encode())
    assert note.text == TEXT and [s.name for s in note.signatures] == ["PeterNeumann", "EnochRoot"]
    assert verify_note_signature(note, peter) and verify_note_signature(note, enoch)
    assert [s.line() for s in note.signatures] == [PETER_SIG, ENOCH_SIG]
    # an invalid signature of a known key rejects the note; an unknown key is not looked at
    bad = parse_note((TEXT + "\n" + PETER_SIG[:60] + "ABCD" + PETER_SIG[60:]).encode())
    with pytest.raises(VerificationError, match="does not verify"):
        verify_note_signature(bad, peter)
    assert verify_note_signature(bad, enoch) is False
    # repeated lines are kept once; a bad line of an unknown key stays unverified
    repeated = parse_note((TEXT + "\n" + PETER_SIG + PETER_SIG + ENOCH_SIG + ENOCH_SIG + ENOCH_SIG[:60] + "ABCD"
                           + ENOCH_SIG[60:]).encode())
    assert len(repeated.signatures) == 3 and verify_note_signature(repeated, peter)
    # a line of peter's signature under another name, or with another key ID, is not peter's
    misnamed = parse_note((TEXT + "\n" + PETER_SIG.replace("PeterNeumann", "CarmenSandiego")).encode())
    wrong_id = parse_note((TEXT + "\n" + PETER_SIG.replace("x08g", "xxxx")).encode())
    assert verify_note_signature(misnamed, peter) is False and verify_note_signature(wrong_id, peter) is False


@pytest.mark.parametrize("msg", [
    TEXT,  # note_test.go's badMsgs, in order
    TEXT + "\n",
    TEXT + "\n" + PETER_SIG[:-1],
    "\x01" + TEXT + "\n" + PETER_SIG,
    "\xff" + TEXT + "\n" + PETER_SIG,  # (as bytes below: not UTF-8)
    TEXT + "\n" + "— Bad Name x08go/ZJkuBS9UG/SffcvIAQxVBtiFupLLr8pAcElZInNIuGUgYN1FFYC2pZSNXgKvqfqdngotpRZb6KE6RyyBwJnAM=",
    TEXT + "\n" + PETER_SIG + "Unexpected line.\n",
    TEXT + "\n" + PETER_SIG * 101,  # too many signatures
    TEXT + "\n— PeterNeumann x08go/ZJkuBS9UG/SffcvIAQxVBtiFupLLr8pAcElZInNIuGUgYN1FFYC2pZSNXgKvqfqdngotpRZb6KE6RyyBwJn\n",
    TEXT + "\n— PeterNeumann x08go/ZJkuBS9UG*SffcvIAQxVBtiFupLLr8pAcElZInNIuGUgYN1FFYC2pZSNXgKvqfqdngotpRZb6KE6RyyBwJnAM=\n",
    TEXT + "\n— PeterNeumann \n",
    TEXT + "\n— PeterNeumann AAAA\n",  # a key ID and no signature
    TEXT + "\n— Peter+Neumann x08go/ZJkuBS9UG/SffcvIAQxVBtiFupLLr8pAcElZInNIuGUgYN1FFYC2pZSNXgKvqfqdngotpRZb6KE6RyyBwJnAM=\n",
    TEXT.replace("\n", "\r\n", 1) + "\n" + PETER_SIG,
    TEXT + "\n-- PeterNeumann x08go/ZJkuBS9UG/SffcvIAQxVBtiFupLLr8pAcElZInNIuGUgYN1FFYC2pZSNXgKvqfqdngotpRZb6KE6RyyBwJnAM=\n",
])
def test_malformed_notes_are_refused(msg):
    data = b"\xff" + msg[1:].encode() if msg.startswith("\xff") else msg.encode()
    with pytest.raises(MalformedInput):
        parse_note(data)


def test_a_note_over_its_byte_bound_is_refused():
    msg = (TEXT + "\n" + PETER_SIG).encode()
    assert parse_note(msg, max_bytes=len(msg))
    with pytest.raises(MalformedInput, match="over"):
        parse_note(msg, max_bytes=len(msg) - 1)
    with pytest.raises(MalformedInput, match="over"):
        parse_note(b"x" * (1 << 16) + b"\n\n" + PETER_SIG.encode())


def test_c2sp_signed_note_example_verifies():
    key = NoteKey.parse(C2SP_VKEY)
    assert key.id.hex() == "530d903a"
    note = parse_note(C2SP_NOTE.encode())
    assert note.text == "This is an example message.\n" and verify_note_signature(note, key)
    assert note.encode().decode() == C2SP_NOTE
    tampered = parse_note(C2SP_NOTE.replace("example message", "example massage").encode())
    with pytest.raises(VerificationError):
        verify_note_signature(tampered, key)


def test_c2sp_checkpoint_and_cosignature_examples_parse():
    note = parse_note(SOFA_NOTE.encode())
    cp = Checkpoint.parse(note.text)
    assert (cp.origin, cp.size, cp.extensions) == ("example.com/behind-the-sofa", 20852163, ())
    assert cp.text() == SOFA and base64.b64encode(cp.root).decode() == "CsUYapGGPo4dkMgIAUqom/Xajj7h2fB2MPA3j2jxq2I="
    witness = note.signatures[1]
    assert witness.name == "witness.example.com/w1" and witness.key_id.hex() == "8d66cf3f"
    assert cosignature_timestamp(witness) == 1679315147  # the spec's signed message has "time 1679315147"
    assert cosignature_message(SOFA, 1679315147) == SOFA_COSIGNED_MESSAGE.encode()


def test_transparency_dev_cosigner_keys_and_timestamps():
    remora, test = NoteKey.parse(REMORA_VKEY), NoteKey.parse(TEST_VKEY)
    assert (remora.alg, remora.id.hex()) == (COSIGNATURE_V1, "da77ade7") and remora.vkey() == REMORA_VKEY
    assert (test.alg, test.id.hex()) == (ED25519, "7997405c")
    assert cosignature_timestamp(NoteSignature.parse("— x " + COSIG_1727964367)) == 1727964367
    with pytest.raises(VerificationError):  # an Ed25519 note signature is no cosignature
        cosignature_timestamp(NoteSignature.parse("— x " + NOT_COSIG))
    for bad in ("bananas.sigstore.dev+12344556", "rekor.sigstore.dev+12345678+THIS_IS_NOT_BASE64!",
                "rekor.sigstore.dev+12345678+AwEB", "rekor.sigstore.dev+NOT_A_NUMBER+" + REMORA_VKEY.split("+")[2],
                "remora.n621.de+00000000+" + REMORA_VKEY.split("+")[2]):
        with pytest.raises(MalformedInput):
            NoteKey.parse(bad)


def test_a_cosignature_verifies_and_carries_its_time():
    key = generate_key()
    wkey = NoteKey.of("witness.example/w1", key.public_key(), COSIGNATURE_V1)
    sig = cosign(SOFA, wkey.name, key, 1679315147)
    assert sig.key_id == wkey.id and len(sig.sig) == 72 and sig.sig[:8] == (1679315147).to_bytes(8, "big")
    assert verify_cosignature(SOFA, sig, wkey) == 1679315147
    assert NoteKey.parse(wkey.vkey()) == wkey
    # the response of tlog-witness, appended to the checkpoint, is a note of both signatures
    note = parse_note(SOFA_NOTE.encode() + sig.line().encode())
    assert verify_cosignature(note.text, note.signatures[-1], wkey) == 1679315147


def test_a_bad_cosignature_is_refused():
    key, other = generate_key(), generate_key()
    wkey = NoteKey.of("witness.example/w1", key.public_key(), COSIGNATURE_V1)
    sig = cosign(SOFA, wkey.name, key, 1700000000)
    with pytest.raises(VerificationError, match="does not verify"):  # another checkpoint
        verify_cosignature(SOFA.replace("20852163", "20852164"), sig, wkey)
    with pytest.raises(VerificationError, match="not by the witness"):  # another witness
        verify_cosignature(SOFA, sig, NoteKey.of("witness.example/w1", other.public_key(), COSIGNATURE_V1))
    with pytest.raises(VerificationError, match="not by the witness"):  # another name
        verify_cosignature(SOFA, NoteSignature("witness.example/w2", sig.key_id, sig.sig), wkey)
    with pytest.raises(VerificationError, match="does not verify"):  # the time changed
        verify_cosignature(SOFA, NoteSignature(sig.name, sig.key_id, (1700000001).to_bytes(8, "big") + sig.sig[8:]),
                           wkey)
    with pytest.raises(VerificationError, match="0x01"):  # a note key is no cosigner key
        verify_cosignature(SOFA, sig, NoteKey.of(wkey.name, key.public_key()))
    for t in (0, 1 << 63):  # signed properly, yet outside the timestamps the spec allows
        raw = key.sign(b"cosignature/v1\ntime %d\n" % t + SOFA.encode())
        with pytest.raises(VerificationError, match="timestamp"):
            verify_cosignature(SOFA, NoteSignature(wkey.name, wkey.id, t.to_bytes(8, "big") + raw), wkey)
    with pytest.raises(ValueError):
        cosign(SOFA, wkey.name, key, 0)
    with pytest.raises(MalformedInput):  # a cosigner signs checkpoints only
        cosign("not a checkpoint\n", wkey.name, key, 1700000000)


def test_a_note_key_verifies_notes_only():
    key = generate_key()
    nkey = NoteKey.of("example.com/log", key.public_key())
    note = Note(SOFA, (sign_note(SOFA, nkey.name, key),))
    assert verify_note_signature(parse_note(note.encode()), nkey)
    with pytest.raises(VerificationError, match="0x04"):
        verify_note_signature(note, NoteKey.of(nkey.name, key.public_key(), COSIGNATURE_V1))
    with pytest.raises(MalformedInput):
        sign_note("no newline", nkey.name, key)
    with pytest.raises(MalformedInput):
        sign_note(SOFA, "a name", key)


@pytest.mark.parametrize("text", [
    "example.com/log\n020852163\nCsUYapGGPo4dkMgIAUqom/Xajj7h2fB2MPA3j2jxq2I=\n",  # a leading zero
    "example.com/log\n+20852163\nCsUYapGGPo4dkMgIAUqom/Xajj7h2fB2MPA3j2jxq2I=\n",
    "example.com/log\n 20852163\nCsUYapGGPo4dkMgIAUqom/Xajj7h2fB2MPA3j2jxq2I=\n",
    "example.com/log\n2085_2163\nCsUYapGGPo4dkMgIAUqom/Xajj7h2fB2MPA3j2jxq2I=\n",
    "example.com/log\n\u0661\nCsUYapGGPo4dkMgIAUqom/Xajj7h2fB2MPA3j2jxq2I=\n",  # a digit that is not ASCII
    "example.com/log\n18446744073709551616\nCsUYapGGPo4dkMgIAUqom/Xajj7h2fB2MPA3j2jxq2I=\n",  # 2^64
    "example.com/log\n20852163\nCsUYapGGPo4dkMgIAUqom/Xajj7h2fB2MPA3j2jxq2J=\n",  # stray bits: not canonical
    "example.com/log\n20852163\nCsUYapGGPo4dkMgIAUqom/Xajj7h2fB2MPA3j2jxq2I\n",  # unpadded
    "example.com/log\n20852163\nCsUYapGGPo4dkMgIAUqom/Xajj7h2fB2MPA3j2jxqw==\n",  # 31 bytes
    "example.com/log\n20852163\n\n",
    "\n20852163\nCsUYapGGPo4dkMgIAUqom/Xajj7h2fB2MPA3j2jxq2I=\n",  # no origin
    "example.com/log\n20852163\n",
    "example.com/log\n20852163\nCsUYapGGPo4dkMgIAUqom/Xajj7h2fB2MPA3j2jxq2I=",  # no final newline
    "example.com/log\n20852163\nCsUYapGGPo4dkMgIAUqom/Xajj7h2fB2MPA3j2jxq2I=\n\n",  # an empty extension line
    "example.com/log\n20852163\nCsUYapGGPo4dkMgIAUqom/Xajj7h2fB2MPA3j2jxq2I=\nok\x00\n",
])
def test_malformed_checkpoints_are_refused(text):
    with pytest.raises(MalformedInput):
        Checkpoint.parse(text)


def test_checkpoint_sizes_and_extensions():
    assert Checkpoint.parse("log\n0\n" + "A" * 43 + "=\n").size == 0
    top = Checkpoint.parse("log\n18446744073709551615\n" + "A" * 43 + "=\nan extension\n")
    assert top.size == (1 << 64) - 1 and top.extensions == ("an extension",)
    assert Checkpoint.parse(top.text()) == top


def test_run_origin_and_origin_hash():
    origin = run_origin(bytes(range(32)))
    assert origin == "witness.run/" + bytes(range(32)).hex() and is_run_origin(origin)
    assert not is_run_origin(origin.upper()) and not is_run_origin(origin + "0") and not is_run_origin(None)
    assert origin_hash("example.com/log") == hashlib.sha256(b"example.com/log").hexdigest()
    with pytest.raises(ValueError):
        run_origin(b"short")


def test_weak_and_malformed_keys_are_refused():
    with pytest.raises(MalformedInput, match="small-order"):
        NoteKey("example.com/log", ED25519, bytes(32))
    with pytest.raises(MalformedInput, match="type"):
        NoteKey("example.com/log", 0x02, NoteKey.parse(PETER_VKEY).public)
    for name in ("", "a b", "a+b", "a\u00a0b", "a\x7fb", "x" * 256, "\ud800"):
        with pytest.raises(MalformedInput):
            NoteKey(name, ED25519, NoteKey.parse(PETER_VKEY).public)
    upper = PETER_VKEY.replace("c74f20a3", "C74F20A3")  # Go's ParseUint takes it; the spec's hex is lowercase
    with pytest.raises(MalformedInput):
        NoteKey.parse(upper)


# --- tlog-cosignature's ML-DSA-44 type (0x06) and signed-note's unknown lines --------------------
def _subtree_message_by_hand(name: str, timestamp: int, origin: str, size: int, root: bytes) -> bytes:
    """tlog-cosignature's ``cosigned_message``, spelled out field by field from the spec."""
    return (b"subtree/v1\n\x00" + bytes([len(name.encode())]) + name.encode() + timestamp.to_bytes(8, "big")
            + bytes([len(origin.encode())]) + origin.encode() + (0).to_bytes(8, "big") + size.to_bytes(8, "big") + root)


def test_an_ml_dsa_44_cosignature_signs_the_subtree_message_and_verifies():
    from cryptography.hazmat.primitives.asymmetric.mldsa import MLDSA44PrivateKey

    from witness.commit.cosignature import cosigner_key
    from witness.commit.note import COSIGNATURE_MLDSA44

    key = MLDSA44PrivateKey.generate()
    wkey = cosigner_key("witness.example/pq", key)
    public = key.public_key().public_bytes_raw()
    assert wkey.alg == COSIGNATURE_MLDSA44 == 0x06 and wkey.public == public and len(public) == 1312
    assert wkey.id == hashlib.sha256(b"witness.example/pq\n\x06" + public).digest()[:4]  # the spec's key ID
    assert NoteKey.parse(wkey.vkey()) == wkey and len(wkey.vkey()) > 1024
    sig = cosign(SOFA, wkey.name, key, 1679315147)
    assert sig.key_id == wkey.id and len(sig.sig) == 8 + 2420 and cosignature_timestamp(sig) == 1679315147
    assert verify_cosignature(SOFA, sig, wkey) == 1679315147
    root = base64.b64decode("CsUYapGGPo4dkMgIAUqom/Xajj7h2fB2MPA3j2jxq2I=")
    key.public_key().verify(sig.sig[8:], _subtree_message_by_hand(wkey.name, 1679315147, "example.com/behind-the-sofa",
                                                                  20852163, root))
    # the message holds no extension line: the same cosignature stands for the checkpoint with one
    assert verify_cosignature(SOFA + "an extension\n", sig, wkey) == 1679315147
    # within a note of the log's and other witnesses' lines, after tlog-witness's answer
    note = parse_note(SOFA_NOTE.encode() + sig.line().encode())
    assert [verify_cosignature(note.text, s, wkey) for s in note.of_key(wkey)] == [1679315147]


def test_a_bad_ml_dsa_44_cosignature_is_refused():
    from cryptography.hazmat.primitives.asymmetric.mldsa import MLDSA44PrivateKey

    from witness.commit.cosignature import cosigner_key

    key = MLDSA44PrivateKey.generate()
    wkey = cosigner_key("witness.example/pq", key)
    sig = cosign(SOFA, wkey.name, key, 1700000000)
    for text in (SOFA.replace("20852163", "20852164"), SOFA.replace("example.com", "example.org"),
                 SOFA.replace("CsUY", "DsUY")):  # another size, origin, root
        with pytest.raises((VerificationError, MalformedInput)):
            verify_cosignature(text, sig, wkey)
    with pytest.raises(VerificationError, match="does not verify"):  # the time changed
        verify_cosignature(SOFA, NoteSignature(sig.name, sig.key_id, (1700000001).to_bytes(8, "big") + sig.sig[8:]),
                           wkey)
    renamed = cosigner_key("witness.example/pq2", key)  # the message commits to the name: another name fails
    with pytest.raises(VerificationError, match="does not verify"):
        verify_cosignature(SOFA, NoteSignature(renamed.name, renamed.id, sig.sig), renamed)
    other = cosigner_key("witness.example/pq", MLDSA44PrivateKey.generate())
    with pytest.raises(VerificationError, match="not by the witness"):
        verify_cosignature(SOFA, sig, other)
    ed = generate_key()  # an Ed25519 cosignature's bytes under the ML-DSA key's line, and the other way round
    with pytest.raises(VerificationError, match="type 0x06"):
        verify_cosignature(SOFA, NoteSignature(wkey.name, wkey.id, cosign(SOFA, wkey.name, ed, 1700000000).sig), wkey)
    edkey = NoteKey.of(wkey.name, ed.public_key(), COSIGNATURE_V1)
    with pytest.raises(VerificationError, match="type 0x04"):
        verify_cosignature(SOFA, NoteSignature(edkey.name, edkey.id, sig.sig), edkey)
    with pytest.raises(MalformedInput):  # a vkey of type 0x06 with a key of Ed25519's size, and the reverse
        NoteKey("w", 0x06, b"\x01" * 32)
    with pytest.raises(MalformedInput):
        NoteKey("w", COSIGNATURE_V1, wkey.public)


def test_a_line_of_an_unknown_key_is_ignored_whatever_its_spelling():
    """signed-note: lines of keys a verifier does not know are ignored. Go's reader takes base64 with
    stray bits and names over 255 bytes; such a line of another key is ignored here too, and one of a
    key that is checked is refused (its strict spelling is the only one a signer makes)."""
    peter, enoch = NoteKey.parse(PETER_VKEY), NoteKey.parse(ENOCH_VKEY)
    stray = ENOCH_SIG[:-4] + "QR=\n"  # ...QQ= -> ...QR=: the same bytes, a non-zero padding bit
    long_name = "— " + "x" * 300 + " " + ENOCH_SIG.split(" ")[2]
    for extra in (stray, long_name):
        note = parse_note((TEXT + "\n" + PETER_SIG + extra).encode())
        assert verify_note_signature(note, peter) and len(note.signatures) == 1
        assert verify_note_signature(note, NoteKey.parse(C2SP_VKEY)) is False
    with pytest.raises(MalformedInput, match="strict spelling"):  # enoch's own line, badly spelled
        verify_note_signature(parse_note((TEXT + "\n" + PETER_SIG + stray).encode()), enoch)
    bad_peter = PETER_SIG[:-3] + "N=\n"  # AM= -> AN=
    with pytest.raises(MalformedInput, match="strict spelling"):
        verify_note_signature(parse_note((TEXT + "\n" + bad_peter + ENOCH_SIG).encode()), peter)
    assert verify_note_signature(parse_note((TEXT + "\n" + bad_peter + ENOCH_SIG).encode()), enoch)


def _forged_under_a_zero_t1(public: bytes, message: bytes, context: bytes = b"") -> bytes:
    """An ML-DSA-44 "signature" that verifies under a key whose t1 is zero: z = 0, no hints, c~ from mu
    and w1 = 0 (FIPS 204's verification, solved for such a key)."""
    shake = lambda b, n: hashlib.shake_256(b).digest(n)  # noqa: E731
    mu = shake(shake(public, 64) + bytes([0, len(context)]) + context + message, 64)
    z = sum((1 << 17) << (18 * i) for i in range(1024))  # each coefficient gamma1 - 0
    return shake(mu + bytes(768), 32) + z.to_bytes(2304, "little") + bytes(84)


def test_a_weak_ml_dsa_44_key_is_refused_as_a_small_order_ed25519_key_is():
    """Under an ML-DSA-44 key whose t1 is zero anyone signs anything (the reviewers' forgery, which the
    library verifies): such a key, or one of mostly zeros, is refused wherever a key is parsed."""
    import os

    from cryptography.hazmat.primitives.asymmetric.mldsa import MLDSA44PublicKey

    weak = os.urandom(32) + bytes(1280)
    MLDSA44PublicKey.from_public_bytes(weak).verify(_forged_under_a_zero_t1(weak, b"anything"), b"anything")
    sparse = bytearray(weak)
    for i in range(11):  # a few coefficients set to 1: still forgeable with hints, still refused
        sparse[32 + 5 * i] = 1
    for public in (weak, bytes(sparse)):
        with pytest.raises(MalformedInput, match="weak ML-DSA-44"):
            NoteKey("evil.example/w", 0x06, public)
        with pytest.raises(MalformedInput):
            NoteKey.parse("evil.example/w+" + key_id("evil.example/w", 0x06, public).hex() + "+"
                          + base64.b64encode(b"\x06" + public).decode())


def test_a_witness_name_holding_an_equals_sign_is_pinned_by_its_vkey():
    from cryptography.hazmat.primitives.asymmetric.mldsa import MLDSA44PrivateKey

    from witness.cli.audit import witness_key
    from witness.commit.cosignature import cosigner_key

    for key in (MLDSA44PrivateKey.generate(), generate_key()):
        k = cosigner_key("w.example/a=b", key)
        assert witness_key(k.vkey()) == k


def test_a_line_go_refuses_is_refused_here_too():
    """Go's StdEncoding refuses base64 padded past a multiple of four: so does the lenient reading of an
    unknown key's line (only what Go takes is ignored rather than refused)."""
    with pytest.raises(MalformedInput):
        parse_note((TEXT + "\n" + PETER_SIG + "— other.example/k AAAAAAAAAAAA=\n").encode())
    assert parse_note((TEXT + "\n" + PETER_SIG + "— other.example/k AAAAAAAAAAB=\n").encode()).others  # stray bits
