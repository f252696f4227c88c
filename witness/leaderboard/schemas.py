"""The bodies the leaderboard API takes, strictly: unknown fields and lax coercions are refused."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..commit.hashing import text_problem
from ..web import MAX_JSON_BODY


class StrictModel(BaseModel):
    """A request body: JSON types as they are ("5" and true are not counts), no unknown fields, and
    every text one the databases can keep (checked here, so a bad one is a 400 naming its field)."""

    model_config = ConfigDict(strict=True, extra="forbid")

    @model_validator(mode="after")
    def _texts(self) -> StrictModel:
        for name in type(self).model_fields:
            problem = text_problem(getattr(self, name))
            if problem:
                raise ValueError(f"{name} {problem}")
        return self


class AccountIn(StrictModel):
    """A registration: a name and an Ed25519 public key (64 hex digits, or PEM SubjectPublicKeyInfo)."""

    name: str = Field(max_length=64)
    public_key: str = Field(max_length=512)


class RunInfo(StrictModel):
    """What the submitter says of a run: a name, a description and a link to its code."""

    title: str | None = Field(default=None, max_length=100)
    description: str | None = Field(default=None, max_length=2000)
    code_url: str | None = Field(default=None, max_length=300)


class TicketIn(RunInfo):
    """A ticket request for a track, with what the submitter says of the run (optional)."""

    track: str = Field(max_length=64)
    method: int | None = Field(default=None, ge=1, le=2**31 - 1)  # a contest track: one of the account's methods


class HeadIn(StrictModel):
    """A streamed tree head, its consistency proof from the last one, and (first head only) the manifest."""

    tree_head: dict[str, Any]
    consistency: list[str] = Field(default_factory=list, max_length=64)
    manifest: str | None = Field(default=None, max_length=MAX_JSON_BODY)
    # a run with online challenges: the log's records this head newly covers
    records: list[str] = Field(default_factory=list, max_length=10_000)


class WindowIn(StrictModel):
    """A witnessed window, as the run's bundle keeps it (``witness.commit.window.WitnessedWindow``)."""

    window: dict[str, Any]


class ChallengeIn(StrictModel):
    """A request for more replay challenges."""

    count: int
