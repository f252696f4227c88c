"""What the leaderboard's routes depend on: a database session per request, the account its
bearer token names, and a run id checked against the tables' range."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request
from fastapi import Path as Path_
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

from .db import Account

# a run's id in a path: the tables' ids are 32-bit integers, so anything else is a 400, not a 500
RunId = Annotated[int, Path_(ge=1, le=2**31 - 1)]


def _session(request: Request):
    with request.app.state.lb.Session() as s:
        yield s


DB = Annotated[Session, Depends(_session)]


_bearer = HTTPBearer(auto_error=False)


def _account(request: Request, s: DB, cred: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]) -> Account:
    return request.app.state.lb.authenticate(s, cred.credentials if cred else None)


Acct = Annotated[Account, Depends(_account)]
