"""Online challenges: a beacon's signed statements, and the steps their randomness selects.

A beacon stamps each tree head a trainer streams to it with 32 fresh random bytes (beta) and
signs the statement. The statement's *window* is every step whose record the head newly covers
(after the head the beacon stamped before it for the same run); each step of the window is
selected with probability p by a PRF of beta and the step. The records, state hashes included,
were signed before beta existed, so the trainer cannot shape a step for the draw.

Log positions: record 0 is the manifest and record t + 1 the record of step t, so a head of size
n covers steps 0 .. n - 2 (and, at the end, the end record).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from ..errors import MalformedInput, VerificationError
from .hashing import canonical_json, from_hex, leaf_hash, tagged_hash
from .signing import public_hex

STATEMENT_FORMAT = "witness-beacon-statement"
# Version 2 adds, to a run's final statement, what the beacon knows of the trainer's other attempts:
# ``others``, the runs it linked to this one (same signing key, recipe, run seed or, at a leaderboard,
# account), and ``attempts``, those it prices into the bound: attempts that shared this run's
# computation (the same run seed and training recipe) and, at a leaderboard, the account's runs
# that were not certified. A trainer that restarts until a draw misses its bad steps is priced in.
# Version 3 has version 2's fields, but its ``attempts`` are every run of the same run seed, whatever
# its recipe (version 2 priced the same seed *and* recipe, which an inert recipe field escaped).
STATEMENT_VERSION = 3
# version 1 statements (witness 0.5) verify but count no attempts; version 2 counts under the old rule,
# so a verifier reads its final count as unknown
STATEMENT_VERSIONS = (1, 2, 3)
SEED_PRICED_VERSION = 3  # the first version whose final statement prices every run of the seed
CONTEXT = b"witness beacon statement v1\x00"  # domain separation: never a valid tree-head signature
BETA_BYTES = 32
MAX_STATEMENT_BYTES = 4096
MAX_INT = 1 << 62  # sizes, times and counts (beyond any database's integer: refused, not overflowed)
_FIELDS = {"format", "version", "beacon", "run", "size", "root", "prev_size", "beta", "received_ms", "final",
           "signature"}
_ATTEMPTS = {"others", "attempts"}  # on a final statement of version 2 or later only


def run_id(manifest_line: bytes) -> bytes:
    """A run's name at a beacon: the leaf hash of its manifest (the root of the head of size 1)."""
    return leaf_hash(manifest_line)


# What a recipe is, for linking runs: the manifest without its seed (r, run_seed and the initial state
# they give), its key, the settings that do not change what is trained (checkpoint cadence, threads,
# online settings) and, in the task's config, the fields that only shape what is observed of the
# training (the probes, the fingerprint and the sketch).
RECIPE_FIELDS = ("task", "task_config", "data_root", "dataset_size", "steps_planned")
OBSERVATIONAL = ("fingerprint_dims", "sketch_dims", "probes", "probe_len")


def recipe_id(manifest: dict) -> bytes:
    """The training a manifest's recipe defines, as a hash."""
    config = manifest.get("task_config")
    if isinstance(config, dict):
        config = {k: v for k, v in config.items() if k not in OBSERVATIONAL}
    return tagged_hash("witness/recipe/v1", canonical_json({**{k: manifest.get(k) for k in RECIPE_FIELDS},
                                                            "task_config": config}))


@dataclass(frozen=True)
class BeaconStatement:
    """A beacon's signed answer to one tree head: the head, where its window starts, and beta."""

    beacon: str  # the beacon's public key (hex): informative; the verifier names the key it trusts
    run: bytes
    size: int
    root: bytes
    prev_size: int  # the size of the head the beacon stamped before this one for the run (0: none)
    beta: bytes
    received_ms: int
    final: bool  # the head is the run's last (it carries the end record's extensions)
    signature: bytes = b""
    # a final statement's count of other runs linked to this one, and of the attempts among them that
    # are priced into the bound (None: not a final statement, or a version 1 one, which counts none)
    others: int | None = None
    attempts: int | None = None
    version: int = STATEMENT_VERSION

    def body(self) -> dict:
        """Everything but the signature."""
        out = {"format": STATEMENT_FORMAT, "version": self.version, "beacon": self.beacon,
               "run": self.run.hex(), "size": self.size, "root": self.root.hex(), "prev_size": self.prev_size,
               "beta": self.beta.hex(), "received_ms": self.received_ms, "final": self.final}
        if self.others is not None:
            out |= {"others": self.others, "attempts": self.attempts}
        return out

    def message(self) -> bytes:
        """The exact bytes that are signed."""
        return CONTEXT + canonical_json(self.body())

    def signed(self, key: Ed25519PrivateKey) -> BeaconStatement:
        """This statement, signed by the beacon's ``key``."""
        if public_hex(key.public_key()) != self.beacon:
            raise ValueError("the statement names another beacon key")
        return BeaconStatement(**{**self.__dict__, "signature": key.sign(self.message())})

    def verify(self, public: Ed25519PublicKey) -> None:
        """Raise unless ``public`` (the key the verifier trusts) signed this statement."""
        if public_hex(public) != self.beacon:
            raise VerificationError(f"a beacon statement (head of size {self.size}) is signed by beacon "
                                    f"{self.beacon[:16]}…, not by the beacon key the verifier named "
                                    f"({public_hex(public)[:16]}…)", check="beacon")
        try:
            public.verify(self.signature, self.message())
        except InvalidSignature:
            raise VerificationError(f"the beacon's signature on its statement for the head of size {self.size} "
                                    "is invalid", check="beacon") from None

    def to_json(self) -> dict:
        """JSON form."""
        return self.body() | {"signature": self.signature.hex()}

    @classmethod
    def from_json(cls, obj: object) -> BeaconStatement:
        """Strictly parse the JSON form."""
        if not isinstance(obj, dict) or obj.get("format") != STATEMENT_FORMAT or type(obj.get("version")) is not int \
                or obj["version"] not in STATEMENT_VERSIONS:
            raise MalformedInput("not a beacon statement of a supported version")
        counted = obj["version"] >= 2 and obj.get("final") is True
        fields = _FIELDS | (_ATTEMPTS if counted else set())
        if set(obj) != fields:
            raise MalformedInput("a beacon statement has exactly the fields " + ", ".join(sorted(fields)))
        for f in ("size", "prev_size", "received_ms", *(_ATTEMPTS if counted else ())):
            if type(obj[f]) is not int or not 0 <= obj[f] < MAX_INT:
                raise MalformedInput(f"beacon statement: {f} must be a non-negative integer")
        if not obj["prev_size"] < obj["size"]:
            raise MalformedInput("beacon statement: its window is empty (prev_size >= size)")
        if type(obj["final"]) is not bool:
            raise MalformedInput("beacon statement: final must be true or false")
        try:
            from_hex(obj["beacon"], "beacon key")
            return cls(obj["beacon"], from_hex(obj["run"], "run"), obj["size"], from_hex(obj["root"], "root"),
                       obj["prev_size"], from_hex(obj["beta"], "beta", BETA_BYTES), obj["received_ms"],
                       obj["final"], from_hex(obj["signature"], "signature", 64),
                       obj.get("others"), obj.get("attempts"), obj["version"])
        except ValueError as e:
            raise MalformedInput(f"beacon statement: {e}") from None

    def window(self, steps: int) -> range:
        """The steps this statement's head newly covers, among a run's first ``steps``."""
        return window(self.prev_size, self.size, steps)


def window(prev_size: int, size: int, steps: int) -> range:
    """Steps whose records lie at log positions prev_size .. size - 1 (record t + 1 is step t's)."""
    return range(max(prev_size - 1, 0), max(min(size - 1, steps), 0))


def threshold(p: float) -> int:
    """A step is selected when its 64-bit PRF value is below this."""
    if not (isinstance(p, float) and 0.0 < p <= 1.0):
        raise ValueError("the selection probability p must be a float in (0, 1]")
    return min(math.floor(p * 2**64), 2**64)


def selected(beta: bytes, step: int, p: float) -> bool:
    """Whether ``step`` is challenged under ``beta``: independently, with probability p."""
    x = int.from_bytes(tagged_hash("witness/online-select/v1", beta, step.to_bytes(8, "big"))[:8], "big")
    return x < threshold(p)


def selected_steps(statement: BeaconStatement, p: float, steps: int) -> list[int]:
    """The steps of a statement's window that its beta selects."""
    return [t for t in statement.window(steps) if selected(statement.beta, t, p)]


def online_bound(p: float, bad_fraction: float, steps: int, unaudited: int = 0, attempts: int = 0) -> float:
    """Lower bound on catching a run with a fraction f of its T steps bad: each bad step is selected
    independently with probability p, and a dishonest trainer puts its bad steps where no statement
    looks first, so one attempt escapes with (1 - p)^b, b = max(0, ceil(fT) - unaudited); a trainer
    that walked away from ``attempts`` other attempts presents one that escaped, so the bound over
    all of them is (1 - (1 - p)^b)^(attempts + 1)."""
    bad = max(0, math.ceil(bad_fraction * steps - 1e-9) - unaudited)
    return (1.0 - (1.0 - p) ** bad) ** (attempts + 1)


def p_needed(confidence: float, bad_fraction: float, steps: int) -> float:
    """The smallest p whose bound reaches ``confidence`` over ``steps`` steps with a fraction f bad."""
    bad = max(1, math.ceil(bad_fraction * steps - 1e-9))
    return min(1.0, 1.0 - (1.0 - confidence) ** (1.0 / bad))
