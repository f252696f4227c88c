"""The board's own history (``witness.leaderboard.board``): every decision the server signs is an entry
of an append-only log whose checkpoints it signs. It verifies from the server's pages, and an entry
edited or removed after a reader kept a checkpoint is caught."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient
from lbhelpers import make_settings, register, submit, train_and_certify

from witness.cli import main
from witness.errors import VerificationError
from witness.leaderboard.app import create_app
from witness.leaderboard.board import fetch_and_check
from witness.leaderboard.db import BoardEntry
from witness.leaderboard.service import Leaderboard
from witness.leaderboard.worker import work
from witness.web import start_uvicorn, stop_uvicorn


@pytest.fixture(params=["sqlite", "postgresql"])
def server(request, tmp_path):
    lb = Leaderboard(make_settings(request.param, tmp_path))
    with TestClient(create_app(lb=lb)) as tc:
        yield lb, tc
    lb.engine.dispose()


def _certify(lb, tc, trainer, out) -> None:
    run_id, bundle, cert = train_and_certify(tc, trainer, out)
    submit(tc, trainer, bundle, cert)
    assert work(lb, once=True) == 1


def test_every_decision_is_an_entry_and_an_edit_is_caught(server, tmp_path):
    lb, tc = server
    alice = register(tc, "alice")
    note0, cp = fetch_and_check(tc, lb.public_key)
    assert cp.size == 0
    _certify(lb, tc, alice, tmp_path / "a")
    note1, cp = fetch_and_check(tc, lb.public_key, note0)
    entry = json.loads(tc.get("/api/board/entries").json()["entries"][0])
    assert cp.size == 1 and entry["type"] == "decision" and entry["decision"] == "certified"
    page = tc.get("/").text
    assert 'id="board-size">1<' in page and cp.root.hex() in page
    _certify(lb, tc, alice, tmp_path / "b")
    note2, cp = fetch_and_check(tc, lb.public_key, note1)  # consistent with the kept checkpoint
    assert cp.size == 2
    # the server edits its first decision (a certified run quietly listed as rejected)
    with lb.Session() as s:
        row = s.get(BoardEntry, 0)
        row.entry = row.entry.replace('"certified"', '"rejected"')
        s.commit()
    with pytest.raises(VerificationError, match="two histories of size 2: an entry was edited or removed"):
        fetch_and_check(tc, lb.public_key, note2)
    _certify(lb, tc, alice, tmp_path / "c")  # and goes on as if nothing happened
    with pytest.raises(VerificationError, match="does not extend the kept one of size 2"):
        fetch_and_check(tc, lb.public_key, note2)
    # entries the checkpoint does not hold, or a checkpoint another key signed, are refused
    other = register(tc, "other").key
    from witness.commit.signing import public_hex

    with pytest.raises(VerificationError, match="not signed by the server's key"):
        fetch_and_check(tc, public_hex(other.public_key()))


def test_check_board_keeps_the_checkpoint_and_fails_on_a_rewritten_history(tmp_path, capsys):
    lb = Leaderboard(make_settings("sqlite", tmp_path))
    server, thread, url = start_uvicorn(create_app(lb=lb))
    try:
        with TestClient(create_app(lb=lb)) as tc:
            alice = register(tc, "alice")
            _certify(lb, tc, alice, tmp_path / "a")
        keep = tmp_path / "board.checkpoint"
        args = ["leaderboard", "check-board", url, "--server-key", lb.public_key, "--keep", str(keep)]
        assert main(args) == 0 and keep.read_bytes().startswith(b"witness.board/")
        assert "1 entries" in capsys.readouterr().out
        with lb.Session() as s:
            s.query(BoardEntry).delete()  # the whole history removed
            s.commit()
        assert main(args) == 1 and "older than the kept one" in capsys.readouterr().err
    finally:
        stop_uvicorn(server, thread)
        lb.engine.dispose()
