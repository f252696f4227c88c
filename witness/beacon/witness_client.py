"""A client of a tlog-witness that is a witness beacon: register a run's log, add its checkpoints,
read the attempts the witness links to it. Every answer is read within bounds and checked against
the witness's key (pinned, or the one it serves)."""

from __future__ import annotations

import re

import httpx

from ..commit.attempts import AttemptsNote
from ..commit.cosignature import verify_cosignature, verify_witness_note
from ..commit.note import (
    COSIGNER_TYPES,
    Checkpoint,
    NoteKey,
    NoteSignature,
    b64encode,
    origin_hash,
    parse_note,
)
from ..errors import MalformedInput, VerificationError
from .client import Answer, BeaconError, BoundedClient, _detail
from .witness import MAX_BODY, MAX_PROOF_LINES

_COUNT = re.compile(r"0|[1-9][0-9]{0,18}")


class WitnessError(BeaconError):
    """The witness refused a request (``status``, ``detail``; a 409 carries the witness's ``latest``
    size), could not be reached, or answered with something that does not verify."""

    def __init__(self, message: str, status: int | None = None, detail: str = "", latest: int | None = None):
        super().__init__(message)
        self.status, self.detail, self.latest = status, detail, latest


class WitnessClient(BoundedClient):
    """The witness at ``url`` (or behind an ``httpx.Client``); ``vkey`` pins its cosigner key (type 0x04 or 0x06),
    else the key it serves is taken."""

    error = WitnessError

    def __init__(self, url_or_client: str | httpx.Client, vkey: str | None = None, prefix: str = "/api/beacon", *,
                 retries: int = 5, timeout: float = 60.0, patience: float = 600.0, deadline: float = 120.0,
                 ask_key: bool = True):
        """``ask_key=False`` (with ``vkey``): speak only tlog-witness's add-checkpoint, as to a witness of the
        ecosystem, whose key is configured rather than asked for (``prefix`` then "": the URL is the
        witness's own)."""
        super().__init__(url_or_client, what="the witness", empty_url="the witness's URL is empty",
                         retries=retries, timeout=timeout, patience=patience, deadline=deadline)
        self.prefix = prefix
        if not ask_key:
            if vkey is None:
                raise ValueError("a witness whose key is not asked for is pinned to one (vkey)")
            self.key = NoteKey.parse(vkey)
            if self.key.alg not in COSIGNER_TYPES:
                raise ValueError(f"{vkey[:80]!r} is not a cosigner key (type 0x04 or 0x06)")
            return
        resp = self._ask("GET", "/key")
        if resp.status_code != 200:
            raise self._refused("/key", resp)
        answer = self._json(resp)
        served = answer.get("witness_vkey") if isinstance(answer, dict) else None
        try:
            key = NoteKey.parse(served)  # type: ignore[arg-type]
        except MalformedInput as e:
            raise WitnessError(f"{self.where} serves no witness key ({e})") from None
        if key.alg not in COSIGNER_TYPES:
            raise WitnessError(f"{self.where} serves a key of type {key.alg:#04x}, not a cosigner key (0x04 or 0x06)")
        if vkey is not None and NoteKey.parse(vkey) != key:
            raise WitnessError(f"{self.where} serves the witness key {key.vkey()}, not the pinned {vkey}")
        self.key = key  # (it signs its attempts notes too: verify_witness_note)

    def _refused(self, what: str, resp: Answer, latest: int | None = None) -> WitnessError:
        detail = _detail(resp)
        return WitnessError(f"{self.where} refused {what}: {resp.status_code} {detail}", resp.status_code, detail,
                            latest)

    def register(self, manifest_line: bytes) -> dict:
        """Register a run's log by its manifest line (the origin and the log's key follow from it)."""
        resp = self._ask("POST", "/logs", json={"manifest": manifest_line.decode("utf-8")})
        if resp.status_code != 200:
            raise self._refused("the log", resp)
        answer = self._json(resp)
        if not isinstance(answer, dict):
            raise WitnessError(f"{self.where} answered the registration with no object")
        return answer

    def add_checkpoint(self, old: int, proof: list[bytes], note: bytes) -> NoteSignature:
        """The witness's cosignature of the signed checkpoint ``note``, checked; ``WitnessError`` if refused.

        A 409 naming the checkpoint's own size (an answer lost, the request sent again) is asked
        again as a repeat, whose answer is the cosignature first made for it."""
        if len(proof) > MAX_PROOF_LINES:
            raise ValueError(f"a consistency proof has at most {MAX_PROOF_LINES} hashes")
        text = parse_note(note, MAX_BODY).text
        size = Checkpoint.parse(text).size
        resp = self._post_checkpoint(old, proof, note)
        if resp.status_code == 409 and old != size and self._latest(resp) == size:
            resp = self._post_checkpoint(size, [], note)
        if resp.status_code == 200:
            return self._cosignature(text, resp.content)
        raise self._refused(f"the checkpoint of size {size}", resp,
                            self._latest(resp) if resp.status_code == 409 else None)

    def _post_checkpoint(self, old: int, proof: list[bytes], note: bytes) -> Answer:
        body = f"old {old}\n".encode() + b"".join(b64encode(h).encode() + b"\n" for h in proof) + b"\n" + note
        return self._ask("POST", "/add-checkpoint", content=body, patient=True, headers={"Content-Type": "text/plain"})

    def _ask(self, method: str, path: str, **kw) -> Answer:  # noqa: ANN003
        """``_request`` under the prefix, an unreachable witness a ``WitnessError`` too."""
        try:
            return self._request(method, self.prefix + path, **kw)
        except httpx.TransportError as e:
            raise WitnessError(f"{self.where} cannot be reached: {e}") from None

    @staticmethod
    def _json(resp: Answer) -> object:
        try:
            return resp.json()
        except BeaconError as e:
            raise WitnessError(str(e), resp.status_code) from None

    @staticmethod
    def _latest(resp: Answer) -> int | None:
        """The latest size a 409's body names (None if it names none)."""
        try:
            size = resp.content.decode("ascii")
        except UnicodeDecodeError:
            return None
        return int(size[:-1]) if size.endswith("\n") and _COUNT.fullmatch(size[:-1]) else None

    def _cosignature(self, text: str, body: bytes) -> NoteSignature:
        try:  # the answer is signature lines: with the checkpoint before it, a note
            lines = parse_note(text.encode() + b"\n" + body, MAX_BODY + len(text) + 1).signatures
            mine = [s for s in lines if s.name == self.key.name and s.key_id == self.key.id]
            if not mine:
                raise VerificationError("no cosignature by the witness's key")
            for sig in mine:
                verify_cosignature(text, sig, self.key)
        except VerificationError as e:
            raise WitnessError(f"{self.where}'s cosignature does not verify: {e}") from None
        return mine[0]

    def checkpoint(self, origin: str) -> bytes | None:
        """The latest checkpoint the witness cosigned for ``origin`` (its cosignature checked), None if none."""
        resp = self._ask("GET", f"/{origin_hash(origin)}/checkpoint")
        if resp.status_code == 404:
            return None
        if resp.status_code != 200:
            raise self._refused("the checkpoint", resp)
        try:
            note = parse_note(resp.content, MAX_BODY)
            if Checkpoint.parse(note.text).origin != origin:
                raise VerificationError("a checkpoint of another log")
        except VerificationError as e:
            raise WitnessError(f"{self.where} served no checkpoint of {origin}: {e}") from None
        self._cosignature(note.text, "".join(s.line() for s in note.signatures).encode())
        return resp.content

    def attempts(self, origin: str) -> tuple[int, int, bytes]:
        """How many other runs the witness links to ``origin``'s and how many it prices in as attempts,
        and the note it signed saying so (checked against its key)."""
        resp = self._ask("GET", f"/attempts/{origin_hash(origin)}")
        if resp.status_code != 200:
            raise self._refused(f"the attempts of {origin}", resp)
        try:
            note = parse_note(resp.content)
            if not verify_witness_note(note, self.key):
                raise VerificationError("the note is not signed by the witness")
            counted = AttemptsNote.parse(note.text)
            if counted.origin != origin:
                raise VerificationError(f"a note for {counted.origin[:80]!r}, not for {origin}")
        except (VerificationError, MalformedInput) as e:
            raise WitnessError(f"{self.where}'s attempts note does not verify: {e}") from None
        return counted.others, counted.attempts, resp.content
