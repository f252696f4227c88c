"""Every way a dishonest trainer (or anyone after the fact) changes a run is rejected, precisely."""

from __future__ import annotations

import json
import shutil

import pytest
from helpers import log_lines, resign, train_tiny

from witness.bundle.layout import LOG
from witness.bundle.reader import open_bundle
from witness.commit.hashing import canonical_json, parse_canonical_json
from witness.commit.log import RunLog
from witness.errors import MalformedInput, RunRejected, VerificationError
from witness.task.base import StepOutput
from witness.verify import Evidence, Policy, Trust, Verifier

ALL = 10_000  # challenge every step: the attack must be caught wherever it sits


_lines = log_lines
_resign = resign


def _write(bundle, lines):
    (bundle / LOG).write_bytes(b"".join(line + b"\n" for line in lines))


def _edit(line: bytes, **changes) -> bytes:
    rec = parse_canonical_json(line)
    rec.update(changes)
    return canonical_json(rec)


def test_honest_run_is_accepted(honest_bundle):
    v = Verifier(policy=Policy(challenges=ALL, nonce=b"x")).verify(honest_bundle)
    assert v.accepted and v.exact and v.challenges == 40 and v.complete


def test_edited_record_breaks_the_signed_root(bundle_copy):
    lines = _lines(bundle_copy)
    lines[8] = _edit(lines[8], loss=0.001)
    _write(bundle_copy, lines)
    with pytest.raises(VerificationError, match="do not hash to signed tree head"):
        Verifier(policy=Policy(challenges=1)).verify(bundle_copy)


def test_edited_and_resigned_record_fails_replay(bundle_copy, signing_key):
    lines = _lines(bundle_copy)
    lines[8] = _edit(lines[8], loss=0.001)
    _resign(bundle_copy, signing_key, lines)
    with pytest.raises(RunRejected, match=r"step 7: replay: replayed loss .* differs from the recorded 0.001"):
        Verifier(policy=Policy(challenges=ALL)).verify(bundle_copy)


def test_edited_fingerprint_resigned_fails_replay(bundle_copy, signing_key):
    lines = _lines(bundle_copy)
    rec = parse_canonical_json(lines[5])
    rec["fingerprint"]["probe_loss"][0] += 1e-6
    _resign(bundle_copy, signing_key, lines[:5] + [canonical_json(rec)] + lines[6:])
    with pytest.raises(RunRejected, match="step 4: replay: replayed behavioral fingerprint differs"):
        Verifier(policy=Policy(challenges=ALL)).verify(bundle_copy)


@pytest.mark.parametrize("resign", [False, True])
def test_dropped_record_is_rejected(bundle_copy, signing_key, resign):
    lines = _lines(bundle_copy)
    del lines[5]
    if resign:
        _resign(bundle_copy, signing_key, lines)
        with pytest.raises(VerificationError, match="is step 5, expected step 4: steps were dropped or reordered"):
            Verifier(policy=Policy(challenges=1)).verify(bundle_copy)
    else:
        _write(bundle_copy, lines)
        with pytest.raises(VerificationError, match="edited, dropped, inserted or reordered"):
            Verifier(policy=Policy(challenges=1)).verify(bundle_copy)


@pytest.mark.parametrize("resign", [False, True])
def test_reordered_records_are_rejected(bundle_copy, signing_key, resign):
    lines = _lines(bundle_copy)
    lines[3], lines[4] = lines[4], lines[3]
    if resign:
        _resign(bundle_copy, signing_key, lines)
        with pytest.raises(VerificationError, match="expected step 2"):
            Verifier(policy=Policy(challenges=1)).verify(bundle_copy)
    else:
        _write(bundle_copy, lines)
        with pytest.raises(VerificationError, match="reordered"):
            Verifier(policy=Policy(challenges=1)).verify(bundle_copy)


def test_every_byte_flip_in_every_file_is_rejected(bundle_copy, tmp_path):
    files = sorted(p for p in bundle_copy.rglob("*") if p.is_file())
    assert len(files) >= 8
    for path in files:
        data = path.read_bytes()
        for pos in sorted({0, len(data) // 3, len(data) // 2, len(data) - 2, len(data) - 1}):
            work = tmp_path / "flip"
            shutil.rmtree(work, ignore_errors=True)
            shutil.copytree(bundle_copy, work)
            target = work / path.relative_to(bundle_copy)
            flipped = bytearray(data)
            flipped[pos] ^= 0x01
            target.write_bytes(bytes(flipped))
            with pytest.raises(VerificationError) as info:
                Verifier(policy=Policy(challenges=1, nonce=b"n")).verify(work)
            assert str(info.value), f"{path.name}@{pos}"


def test_checkpoint_swapped_with_another_runs(bundle_copy, tmp_path, signing_key):
    other = train_tiny(tmp_path / "other", signing_key, r=b"\x09" * 32)
    shutil.copy(other / "checkpoints/00000020.safetensors", bundle_copy / "checkpoints/00000020.safetensors")
    with pytest.raises(VerificationError, match=r"step 20: checkpoint: 00000020.safetensors is not the committed checkpoint file"):
        Verifier(policy=Policy(challenges=1)).verify(bundle_copy)


def test_learning_rate_changed_and_recorded(tmp_path):
    def cheat(rec, t, batch):
        if 20 <= t < 25:
            out = rec.task.train_step(rec.model, rec.optimizer, batch, rec.lr(t) * 3, rec.step_seed(t))
            return out
        return None

    bundle = train_tiny(tmp_path / "b", cheat=cheat)
    with pytest.raises(VerificationError, match=r"step 20: schedule: learning rate .* is not the schedule's"):
        Verifier(policy=Policy(challenges=1)).verify(bundle)


def test_learning_rate_changed_but_schedule_recorded(tmp_path):
    def cheat(rec, t, batch):
        if t == 23:
            out = rec.task.train_step(rec.model, rec.optimizer, batch, rec.lr(t) * 3, rec.step_seed(t))
            return StepOutput(out.loss, rec.lr(t), out.grad_norm)  # lie about the lr used
        return None

    bundle = train_tiny(tmp_path / "b", cheat=cheat)
    with pytest.raises(RunRejected) as info:
        Verifier(policy=Policy(challenges=ALL)).verify(bundle)
    assert info.value.failures == ["step 23: replay: replayed behavioral fingerprint differs from the record "
                                   + info.value.failures[0].split("from the record ", 1)[1]]


def test_steps_logged_without_the_optimizer_stepping(tmp_path):
    def cheat(rec, t, batch):
        if t >= 30:  # claim ten more steps of training than were done
            return StepOutput(1.0, rec.lr(t), 1.0)
        return None

    bundle = train_tiny(tmp_path / "b", cheat=cheat)
    with pytest.raises(VerificationError, match="step 30: record: the parameters did not change"):
        Verifier(policy=Policy(challenges=1)).verify(bundle)


def test_fabricated_steps_with_forged_updates_fail_replay(tmp_path):
    import torch

    def cheat(rec, t, batch):
        if t >= 30:  # nudge the weights instead of training: the records look alive
            with torch.no_grad():
                for p in rec.model.parameters():
                    p.add_(1e-4)
            return StepOutput(0.5, rec.lr(t), 1.0)
        return None

    bundle = train_tiny(tmp_path / "b", cheat=cheat)
    with pytest.raises(RunRejected) as info:
        Verifier(policy=Policy(challenges=ALL)).verify(bundle)
    assert info.value.failures[0].startswith("step 30: replay:")
    failed = [r.step for r in info.value.verdict.results if not r.passed]
    assert failed == list(range(30, 40))  # each later challenge must replay through step 30


def test_training_on_uncommitted_batches_fails_replay(tmp_path):
    bad = {12, 27}

    def cheat(rec, t, batch):
        if t in bad:  # e.g. the test set, or any data it did not commit
            ds = rec.task.dataset()
            other = rec.task.collate([ds.sample_bytes((i * 7 + 3) % len(ds)) for i in rec.batch_indices(t)])
            return rec.task.train_step(rec.model, rec.optimizer, other, rec.lr(t), rec.step_seed(t))
        return None

    bundle = train_tiny(tmp_path / "b", cheat=cheat)
    with pytest.raises(RunRejected) as info:
        Verifier(policy=Policy(challenges=ALL)).verify(bundle)
    assert [f.split(":")[0] for f in info.value.failures] == ["step 12", "step 27"]
    assert all("replayed loss" in f for f in info.value.failures)
    # Interactive mode catches it too: the trainer's own response cannot hide it.
    from witness.verify.respond import respond

    respond(bundle, tmp_path / "resp", nonce=b"n", challenges=ALL)
    with pytest.raises(RunRejected, match="step 12"):
        Verifier(policy=Policy(challenges=ALL, nonce=b"n", mode="interactive")).verify(bundle, Evidence(response=tmp_path / "resp"))


def test_batch_order_not_derived_from_the_seed_is_rejected(bundle_copy, signing_key):
    lines = _lines(bundle_copy)
    rec = parse_canonical_json(lines[3])
    rec["batch"] = list(reversed(rec["batch"]))
    _resign(bundle_copy, signing_key, lines[:3] + [canonical_json(rec)] + lines[4:])
    with pytest.raises(VerificationError, match="step 2: data order"):
        Verifier(policy=Policy(challenges=1)).verify(bundle_copy)


def test_run_seed_not_bound_to_the_data_is_rejected(bundle_copy, signing_key):
    lines = _lines(bundle_copy)
    lines[0] = _edit(lines[0], run_seed="00" * 32)
    _resign(bundle_copy, signing_key, lines)
    with pytest.raises(VerificationError, match="run seed is not H"):
        Verifier(policy=Policy(challenges=1)).verify(bundle_copy)


def test_pinned_signer_rejects_another_key(honest_bundle):
    with pytest.raises(VerificationError, match="not by the pinned key"):
        Verifier(Trust(signer="ab" * 32), Policy(challenges=1)).verify(honest_bundle)
    opened = open_bundle(honest_bundle)  # a bundle opened once and passed on keeps the pin
    with pytest.raises(VerificationError, match="not by the pinned key"):
        Verifier(Trust(signer="ab" * 32), Policy(challenges=1)).verify(opened)


def test_unregistered_task_is_unusable(bundle_copy, signing_key):
    # a task this verifier cannot build from installed code is never run: unusable input (exit 2)
    lines = _lines(bundle_copy)
    lines[0] = _edit(lines[0], task="my_own_code")
    _resign(bundle_copy, signing_key, lines)
    with pytest.raises(MalformedInput, match="not a task of this witness release"):
        Verifier(policy=Policy(challenges=1)).verify(bundle_copy)


def test_offline_needs_the_committed_dataset(bundle_copy, signing_key):
    lines = _lines(bundle_copy)
    m = json.loads(lines[0])
    m["task_config"]["dataset_size"] = 999  # recipe now names a dataset the records were not made from
    _resign(bundle_copy, signing_key, [canonical_json(m)] + lines[1:])
    with pytest.raises(MalformedInput, match="committed dataset"):
        Verifier(policy=Policy(challenges=1)).verify(bundle_copy)


def test_a_published_head_pins_the_log_against_rewriting(bundle_copy, signing_key, tmp_path, capsys):
    from witness.cli import main

    published = tmp_path / "head.json"
    published.write_bytes((bundle_copy / "heads.jsonl").read_bytes().split(b"\n")[2])  # after step 19
    assert main(["verify", "--allow-weak", str(bundle_copy), "--challenges", "1", "--published-head", str(published)]) == 0
    # The trainer rewrites an early record and re-signs everything: every signature is valid...
    lines = _lines(bundle_copy)
    lines[5] = _edit(lines[5], loss=0.001)
    _resign(bundle_copy, signing_key, lines)
    # ...but the log no longer extends the head it published before.
    assert main(["verify", "--allow-weak", str(bundle_copy), "--challenges", "1", "--published-head", str(published)]) == 1
    assert "rewritten after that head was published" in capsys.readouterr().err
    published.write_text("{}")
    assert main(["verify", "--allow-weak", str(bundle_copy), "--published-head", str(published)]) == 2


def _sign_prefix(bundle, key, records: int) -> None:
    """Keep the first ``records`` log records and sign one head over them, as a trainer may."""
    lines = _lines(bundle)[:records]
    log = RunLog()
    for line in lines:
        log.append_line(line)
    _write(bundle, lines)
    (bundle / "heads.jsonl").write_bytes(canonical_json(log.sign_head(key).to_json()) + b"\n")
    for f in (bundle / "checkpoints").iterdir():
        if int(f.name.split(".")[0]) >= records:
            f.unlink()


def test_a_log_signed_past_its_last_checkpoint(bundle_copy, signing_key):
    # The recorder signs heads at checkpoints; a trainer may sign one elsewhere. Exact replay ends
    # on the committed state hashes; tolerance mode needs the committed tensors at the end of a
    # segment, and refuses to end a replay where no checkpoint is.
    _sign_prefix(bundle_copy, signing_key, 16)  # the manifest and steps 0..14; a checkpoint after 10
    v = Verifier(policy=Policy(challenges=ALL)).verify(bundle_copy)
    assert v.accepted and v.steps == 15 and not v.complete
    with pytest.raises(RunRejected, match="no committed state after this step to end its replay on"):
        Verifier(policy=Policy(challenges=ALL, exact=False)).verify(bundle_copy)


def test_a_signed_log_must_end_on_a_committed_state(tmp_path, signing_key):
    bundle = train_tiny(tmp_path / "b", signing_key, state_every=5)
    _sign_prefix(bundle, signing_key, 14)  # ends at step 12; states are committed after 4, 9, 14, ...
    with pytest.raises(VerificationError, match="step 12: log: the signed log ends at a step whose training state"):
        Verifier(policy=Policy(challenges=1)).verify(bundle)


@pytest.mark.parametrize("exact", [True, False])
def test_a_run_from_an_initial_state_of_the_trainers_choosing_is_rejected(tmp_path, exact):
    # The trainer starts from weights of its choosing (here another seed's), commits them as the
    # initial state and trains honestly from there. Tolerance mode, which accepts another CPU's
    # last bits in the seed's weights, must still refuse weights the seed does not give.
    from witness.data.order import derive_run_seed
    from witness.session import TrainingSession
    from witness.task import build_task

    task = build_task("tiny", {"steps": 8})
    r = b"\x05" * 32
    session = TrainingSession(task, derive_run_seed(task.dataset().root, r), len(task.dataset()))
    session.model.load_state_dict(TrainingSession(task, b"\x09" * 32, len(task.dataset())).model.state_dict())
    bundle = train_tiny(tmp_path / "b", r=r, config={"steps": 8}, checkpoint_every=4, session=session)
    with pytest.raises(VerificationError, match="step 0: init: the initial state is not the one the run seed generates"
                                          + ("" if exact else ": parameters distance")):
        Verifier(policy=Policy(challenges=ALL, exact=exact)).verify(bundle)
