"""SHA-256 with domain separation, and the canonical JSON that everything signed uses."""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import os
from collections.abc import Callable, Iterable
from typing import Any

from ..errors import MalformedInput

LEAF_PREFIX = b"\x00"
NODE_PREFIX = b"\x01"
HASH_SIZE = 32


def sha256(data: bytes) -> bytes:
    """SHA-256 digest of ``data``."""
    return hashlib.sha256(data).digest()


_TAG_STATES: dict[str, Any] = {}


def _tagged(tag: str, *parts: bytes) -> Any:
    """The SHA-256 state after an ASCII tag, a NUL, then length-prefixed parts."""
    base = _TAG_STATES.get(tag)
    if base is None:  # the tag's prefix is hashed once, then its state is copied
        base = _TAG_STATES[tag] = hashlib.sha256(tag.encode("ascii") + b"\x00")
    h = base.copy()
    h.update(b"".join(len(p).to_bytes(8, "big") + p for p in parts))
    return h


def tagged_hash(tag: str, *parts: bytes) -> bytes:
    """SHA-256 of an ASCII tag, a NUL, then length-prefixed parts (no ambiguity between parts)."""
    return _tagged(tag, *parts).digest()


def tagged_hashes(tag: str, fixed: tuple[bytes, ...], last: Iterable[bytes]) -> list[bytes]:
    """``tagged_hash(tag, *fixed, x)`` for every ``x`` of ``last``, the shared parts hashed once."""
    base = _tagged(tag, *fixed)
    out = []
    for x in last:
        h = base.copy()
        h.update(len(x).to_bytes(8, "big") + x)
        out.append(h.digest())
    return out


def leaf_hash(data: bytes) -> bytes:
    """RFC 6962 leaf hash: SHA-256(0x00 || data)."""
    return hashlib.sha256(LEAF_PREFIX + data).digest()


def node_hash(left: bytes, right: bytes) -> bytes:
    """RFC 6962 interior node hash: SHA-256(0x01 || left || right)."""
    return hashlib.sha256(NODE_PREFIX + left + right).digest()


def same(a: bytes, b: bytes) -> bool:
    """Constant-time equality of two digests."""
    return hmac.compare_digest(a, b)


def from_hex(value: object, what: str, size: int = HASH_SIZE) -> bytes:
    """Parse a lowercase hex digest of exactly ``size`` bytes, or raise ValueError."""
    if not isinstance(value, str) or len(value) != 2 * size:
        raise ValueError(f"{what} must be {2 * size} hex characters")
    if value != value.lower():
        raise ValueError(f"{what} must be lowercase hex")
    try:
        return bytes.fromhex(value)
    except ValueError:
        raise ValueError(f"{what} is not hex") from None


def parse_hex(value: object, what: str, size: int = HASH_SIZE) -> bytes:
    """``from_hex`` for untrusted input: a malformed value is unusable input, named by ``what``."""
    try:
        return from_hex(value, what, size)
    except ValueError as e:
        raise MalformedInput(str(e)) from None


def _clean(obj: Any) -> Any:
    # Non-finite floats are not JSON; a diverged loss must still be recordable.
    if isinstance(obj, float) and not math.isfinite(obj):
        return "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


def canonical_json(obj: Any) -> bytes:
    """The one byte form of a JSON value: sorted keys, no spaces, UTF-8, shortest floats."""
    try:
        text = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except ValueError:  # only then walk the value to spell out non-finite floats
        text = json.dumps(_clean(obj), sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return text.encode("utf-8")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


def _no_constants(name: str) -> Any:
    raise ValueError(f"non-standard JSON constant {name}")


# Deeper than anything witness writes (a data proof inside a DSSE statement nests about 7 levels):
# the limit keeps every later walk over a parsed value (canonical re-encoding, schema checks)
# far from Python's recursion limit, whatever an input nests.
MAX_JSON_DEPTH = 64


def check_depth(obj: Any, limit: int = MAX_JSON_DEPTH) -> None:
    """Raise ``ValueError`` if ``obj`` nests arrays and objects more than ``limit`` deep (walked
    without recursion, so any depth is safe to check)."""
    stack = [(obj, 1)]
    while stack:
        value, depth = stack.pop()
        children = value.values() if isinstance(value, dict) else value
        if depth > limit:
            raise ValueError(f"nested more than {limit} levels deep")
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))


def load_json(data: bytes | str) -> Any:
    """``json.loads`` for untrusted bytes: anything that is not JSON, including nesting deeper than
    ``MAX_JSON_DEPTH`` or than the parser's recursion allows, is a ``ValueError``."""
    return _parsed(lambda: json.loads(data), lambda e: type(e).__name__)


def _parsed(parse: Callable[[], Any], why: Callable[[Exception], str]) -> Any:
    """What ``parse`` (a ``json.loads``) returns, any failure of it a ``ValueError`` (saying ``why(e)``),
    and the value checked to nest at most ``MAX_JSON_DEPTH`` deep."""
    try:
        obj = parse()
    except RecursionError:
        raise ValueError(f"nested more than {MAX_JSON_DEPTH} levels deep (too deep to parse)") from None
    except (UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"not valid JSON ({why(e)})") from None
    if isinstance(obj, (dict, list)):
        check_depth(obj)
    return obj


def parse_canonical_json(data: bytes) -> Any:
    """Parse JSON and insist that ``data`` is exactly its canonical form (and nests at most
    ``MAX_JSON_DEPTH`` deep)."""
    obj = _parsed(lambda: json.loads(data.decode("utf-8"), object_pairs_hook=_no_duplicates,
                                     parse_constant=_no_constants), str)
    try:
        canonical = canonical_json(obj)
    except (ValueError, RecursionError) as e:  # cannot happen within the depth limit: kept as a guard
        raise ValueError(f"JSON cannot be re-encoded ({type(e).__name__})") from None
    if canonical != data:
        raise ValueError("JSON is not in canonical form")
    return obj


def text_problem(value: Any) -> str | None:  # noqa: ANN401 - any JSON value
    """What makes a text one the databases cannot keep (a NUL: PostgreSQL's text has none; a lone
    surrogate: no UTF-8 spells it), anywhere in a JSON value's strings and keys; None if nothing."""
    if isinstance(value, str):
        if "\x00" in value:
            return "holds a NUL character"
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return "holds a lone surrogate, which is not text"
        return None
    items = list(value.items()) if isinstance(value, dict) else [(None, v) for v in value] \
        if isinstance(value, list) else []
    for k, v in items:
        problem = (text_problem(k) if k is not None else None) or text_problem(v)
        if problem:
            return problem
    return None


def file_sha256(path: str | os.PathLike) -> bytes:
    """SHA-256 of a file's bytes, read in blocks (memory stays small whatever its size)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.digest()
