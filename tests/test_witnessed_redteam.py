"""Red-team attacks on witnessed windows, as a dishonest trainer (who holds its own key and can sign
anything) would mount them against ``witness verify --mode online --witness … --drand …``."""

from __future__ import annotations

from test_witnessed import copy, honest, loop, verify, windows, write_windows  # noqa: F401 - fixtures

from witness.bundle.layout import checkpoint_name, online_state_name
from witness.commit.beacon import selected_steps
from witness.commit.cosignature import cosign
from witness.commit.drand import round_time
from witness.commit.note import Note, parse_note
from witness.commit.window import WitnessedWindow

__all__ = ["honest", "loop"]


def test_hiding_an_on_time_cosignature_does_not_hide_a_draw(honest, loop, tmp_path, capsys):
    """With 1 of 2 witnesses required, a trainer sends each checkpoint to witness 1 in time and to
    witness 2 only once the round's randomness is out. Seeing beta select a step it cannot answer
    (here: its states are gone), it shows witness 2's late cosignature alone, so the window counts as
    "late" and its draw is dropped. The window's beta is fixed all the same (the checkpoint text and
    the round): its selected steps must still be replayed."""
    out = copy(honest, tmp_path)
    objs = windows(out)
    n = sum(1 for _ in (out / "log.jsonl").open("rb")) - 2
    hit = None
    parsed = [WitnessedWindow.from_json(o) for o in objs]
    drawn = {t for w in parsed for t in selected_steps(w, 0.25, n)}
    for i, w in enumerate(parsed):
        sel = selected_steps(w, 0.25, n)
        # a step whose start state is a kept online state and not a checkpoint (which replay would start
        # from: a selected step's state is kept even where a checkpoint holds it, and the window's draw
        # comes from a drand round, so which steps it selects differs from run to run), and whose step
        # before is drawn by no window (replay of that step would reach this one's start state, checked
        # against its committed hash, and go on from it without the file)
        if any((out / online_state_name(t)).exists() and not (out / checkpoint_name(t)).exists()
               and t - 1 not in drawn for t in sel) and not w.final:
            hit = i, w, sel
            break
    assert hit is not None, "no window of the honest run selects a step with a kept state"
    i, w, sel = hit
    for t in sel:  # the trainer cannot answer this draw
        if (out / online_state_name(t)).exists():
            (out / online_state_name(t)).unlink()
    note = parse_note(w.checkpoint)
    trainer_line = [s for s in note.signatures if s.name not in loop.names]
    due = round_time(loop.drand.chain, w.round)
    late = cosign(note.text, loop.names[1], loop.keys[1], due)  # what witness 2 signs when sent at R's time
    objs[i]["checkpoint"] = Note(note.text, (*trainer_line, late)).encode().decode()
    write_windows(out, objs)
    code, v = verify(out, loop, "--witnesses-required", "1", capsys=capsys)
    assert code == 1 and not v["accepted"], v
    assert any("kept no state" in f for f in v["failures"]), v["failures"]
