"""Databases of witness's servers (the leaderboard and the beacon): SQLite, the embedded default, or
PostgreSQL to scale out."""

from __future__ import annotations

from sqlalchemy import Engine, create_engine, event, make_url
from sqlalchemy.exc import ArgumentError
from sqlalchemy.orm import sessionmaker


def check_db_url(url: str) -> str:
    """``url`` if it names a database this server runs on (SQLite or PostgreSQL), else ValueError."""
    try:
        backend = make_url(url).get_backend_name()
    except ArgumentError:
        raise ValueError(f"{url[:100]!r} is not a database URL (sqlite:///PATH or postgresql://…)") from None
    if backend not in ("sqlite", "postgresql"):
        raise ValueError(f"witness's servers run on SQLite or PostgreSQL, not {backend[:40]!r}")
    return url


def shown_url(url: str) -> str:
    """A database URL as it may be printed: its password hidden, its query left out."""
    try:
        return make_url(url).set(query={}).render_as_string(hide_password=True)
    except ArgumentError:
        return url.split("?")[0][:100]


def make_engine(url: str) -> Engine:
    """An engine for ``url``; SQLite gets WAL and a busy timeout so several processes can share it."""
    check_db_url(url)
    if url.startswith("postgresql://"):
        url = "postgresql+psycopg://" + url[len("postgresql://"):]
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"timeout": 30, "check_same_thread": False})

        @event.listens_for(engine, "connect")
        def _pragmas(conn, _record) -> None:  # noqa: ANN001 - DB-API connection
            cur = conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.close()

        return engine
    # as many connections as the server's thread pool has threads (anyio's 40), so that no request
    # queues for one behind the others (under 50 streaming runs, that queue was most of the p95)
    return create_engine(url, pool_pre_ping=True, pool_size=20, max_overflow=20, pool_timeout=30)


def sessions(engine: Engine) -> sessionmaker:
    """A session factory whose objects stay readable after commit."""
    return sessionmaker(engine, expire_on_commit=False)
