"""Strict acceptance of Ed25519 public keys (RFC 8032 point decoding, prime-order subgroup).

``cryptography`` verifies signatures against any 32 bytes it is given as a public key. Under a
small-order key (the all-zero key, the identity, ...) a signature with R = identity and S = 0
verifies for many messages, so a trainer could "sign" without any private key. A key is accepted
here only if its encoding is canonical, it decodes to a curve point, and that point lies in the
prime-order subgroup and is not the identity: exactly the keys ``A = s * B`` that key generation
makes. The arithmetic is plain integers: it runs once per distinct key (cached), not per
signature, so speed does not matter and no constant-time care is needed (keys are public).
"""

from __future__ import annotations

from functools import lru_cache

P = 2**255 - 19
D = (-121665 * pow(121666, -1, P)) % P
L = 2**252 + 27742317777372353535851937790883648493  # the prime order of the base point
SQRT_M1 = pow(2, (P - 1) // 4, P)

Point = tuple[int, int, int, int]  # extended coordinates (X, Y, Z, T), x = X/Z, y = Y/Z, xy = T/Z
IDENTITY: Point = (0, 1, 1, 0)


def _add(a: Point, b: Point) -> Point:
    # RFC 8032 §5.1.4: the complete addition formula for a = -1 twisted Edwards curves.
    x1, y1, z1, t1 = a
    x2, y2, z2, t2 = b
    aa = (y1 - x1) * (y2 - x2) % P
    bb = (y1 + x1) * (y2 + x2) % P
    cc = 2 * t1 * t2 * D % P
    dd = 2 * z1 * z2 % P
    e, f, g, h = bb - aa, dd - cc, dd + cc, bb + aa
    return e * f % P, g * h % P, f * g % P, e * h % P


def _mul(k: int, q: Point) -> Point:
    out = IDENTITY
    while k:
        if k & 1:
            out = _add(out, q)
        q = _add(q, q)
        k >>= 1
    return out


def _is_identity(q: Point) -> bool:
    x, y, z, _ = q
    return x % P == 0 and (y - z) % P == 0


def _decode(raw: bytes) -> Point:
    """RFC 8032 §5.1.3, refusing the non-canonical encodings that section lets through."""
    value = int.from_bytes(raw, "little")
    sign, y = value >> 255, value & ((1 << 255) - 1)
    if y >= P:
        raise ValueError("a non-canonical encoding (y >= 2^255 - 19)")
    u, v = (y * y - 1) % P, (D * y * y + 1) % P
    x = u * pow(v, 3, P) * pow(u * pow(v, 7, P), (P - 5) // 8, P) % P
    if (v * x * x - u) % P != 0:
        x = x * SQRT_M1 % P
        if (v * x * x - u) % P != 0:
            raise ValueError("not a point on the curve")
    if x == 0 and sign:
        raise ValueError("a non-canonical encoding (x = 0 with the sign bit set)")
    if x & 1 != sign:
        x = P - x
    return x, y, 1, x * y % P


@lru_cache(maxsize=1024)
def check_public_key(raw: bytes) -> None:
    """Raise ``ValueError`` unless ``raw`` is a canonical Ed25519 key of prime order."""
    if len(raw) != 32:
        raise ValueError(f"an Ed25519 public key is 32 bytes, not {len(raw)}")
    point = _decode(raw)
    if _is_identity(_mul(8, point)):
        raise ValueError("a small-order point, under which signatures can be forged")
    if not _is_identity(_mul(L, point)):
        raise ValueError("a point outside the prime-order subgroup (it has a small-order component)")
