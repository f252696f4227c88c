"""A verdict never claims more than it checked: each finding of a dishonest trainer against the
bounds, tried through the command a user runs. The bound comes from the ledger of steps actually
replayed, one window has one draw, restarts are priced in, a weak audit does not exit 0, the data
root is named with what it was checked against, and an online upload is taken once."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import threading
from pathlib import Path

import httpx
import pytest
import torch
from lbhelpers import fresh_postgres

from witness.beacon.app import create_app
from witness.beacon.client import BeaconClient
from witness.bundle.layout import STATEMENTS
from witness.cli import main
from witness.commit.beacon import BeaconStatement, online_bound, run_id
from witness.commit.hashing import canonical_json, parse_canonical_json
from witness.commit.log import RunLog
from witness.commit.signing import generate_key, public_hex, save_key
from witness.errors import MalformedInput
from witness.record import Commitments, Online, SelfChecking
from witness.record.online import OnlineSpec
from witness.record.recorder import Recorder
from witness.task import build_task, registry
from witness.task.generic import GenericTask
from witness.verify.replay import SegmentPlan
from witness.web import start_uvicorn, stop_uvicorn

STEPS, P, EVERY = 40, 0.25, 4
SPEC = OnlineSpec(p=P, every=EVERY, ring=2 * EVERY + 1)


class Served:
    """A beacon on loopback (real HTTP: requests can race), on SQLite or PostgreSQL."""

    def __init__(self, db: str):
        self.key = generate_key()
        self.public_key = public_hex(self.key.public_key())
        self.app = create_app(db, self.key)
        self.server, self.thread, self.url = start_uvicorn(self.app)

    def link(self) -> BeaconClient:
        return BeaconClient(self.url)

    def close(self) -> None:
        stop_uvicorn(self.server, self.thread)


@pytest.fixture
def beacon(tmp_path):
    b = Served(f"sqlite:///{tmp_path / 'beacon.db'}")
    yield b
    b.close()


@pytest.fixture(params=["sqlite", "postgresql"])
def either_beacon(request, tmp_path):
    """A beacon on SQLite, then on PostgreSQL (the races are the database's)."""
    b = Served(f"sqlite:///{tmp_path / 'b.db'}" if request.param == "sqlite" else fresh_postgres())
    yield b
    b.close()


def train(out: Path, link, *, key=None, bad: set[int] = frozenset(), steps: int = STEPS, stop: int | None = None,
          config: dict | None = None, task=None, spec: OnlineSpec = SPEC, r: bytes = b"\x05" * 32):
    """A tiny online run; at each step in ``bad`` the trainer nudges the weights first (its committed
    state before the step is the honest one). ``stop``: an attempt walked away from at that step."""
    task = task or build_task("tiny", {"steps": steps, **(config or {})})
    rec = Recorder.create(task, out, key or generate_key(), r=r, commit=Commitments(checkpoint_every=10),
                          online=Online(beacon=link, spec=spec), self_check=SelfChecking(enabled=not bad))
    for t in range(steps if stop is None else stop):
        if t in bad:
            with torch.no_grad():
                for p in rec.model.parameters():
                    p.add_(0.01)
        rec.log_step(t, task.train_step(rec.model, rec.optimizer, rec.batch(t), rec.lr(t), rec.step_seed(t)))
    if stop is None:
        rec.finish()
    else:
        rec.online.wait()  # its heads were answered: the trainer saw the draws, then walked away
        rec.online.close()
    return rec


def statements(bundle: Path) -> list[BeaconStatement]:
    return [BeaconStatement.from_json(parse_canonical_json(x)) for x in (bundle / STATEMENTS).read_bytes().splitlines()]


def cli_json(capsys, *args) -> tuple[int, dict]:
    capsys.readouterr()
    code = main([*map(str, args), "--json"])
    return code, json.loads(capsys.readouterr().out)


def at_once(call, items: list) -> list:
    """``call(item)`` for every item, each in its own thread, all released together; the results."""
    results: list = []
    go = threading.Barrier(len(items))

    def one(item) -> None:
        go.wait()
        results.append(call(item))

    threads = [threading.Thread(target=one, args=(x,)) for x in items]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def post_heads(url: str, bodies: list[dict]) -> list[httpx.Response]:
    """The bodies posted to a beacon's heads at once, each on its own connection."""
    def post(body: dict) -> httpx.Response:
        with httpx.Client(base_url=url, timeout=60) as http:
            return http.post("/api/beacon/heads", json=body)

    return at_once(post, bodies)


# --- finding 1: an offline audit that replays nothing ------------------------------------------

def test_a_plan_never_wraps_around_to_a_later_state():
    plan = SegmentPlan([12, 40], [12, 20, 40])
    assert plan.start(12) == 12 and plan.start(39) == 12
    with pytest.raises(MalformedInput, match="no committed state at or before step 5"):
        plan.start(5)  # the final state (40) was where replay "started" before: it replayed nothing


def test_the_offline_audit_of_an_online_run_left_with_its_final_checkpoint_is_never_accepted(tmp_path, beacon,
                                                                                          capsys):
    # the red team's run: 12 forged steps of 40, then every checkpoint but the final one deleted, and online/
    bad = set(range(14, 26))
    train(tmp_path / "run", beacon.link(), bad=bad)
    run = tmp_path / "run"
    for p in (run / "checkpoints").iterdir():
        if p.name != f"{STEPS:08d}.safetensors":
            p.unlink()
    shutil.rmtree(run / "online")
    for nonce in ("01", "02", "03"):
        capsys.readouterr()
        assert main(["verify", str(run), "--challenges", "30", "--nonce", nonce, "--allow-weak"]) == 2
        err = capsys.readouterr().err
        assert "no committed state at or before step" in err and "ACCEPTED" not in err
    # with the initial checkpoint and the kept states, the offline audit replays from them: the
    # forged steps are caught, and every step counted has its start and end in the ledger
    train(tmp_path / "again", beacon.link(), bad=bad)
    for p in (tmp_path / "again" / "checkpoints").iterdir():
        if p.name not in ("00000000.safetensors", f"{STEPS:08d}.safetensors"):
            p.unlink()
    code, v = cli_json(capsys, "verify", tmp_path / "again", "--challenges", "30", "--nonce", "01", "--allow-weak")
    assert code == 1 and v["verdict"] == "rejected"


def test_every_counted_challenge_has_its_steps_in_the_ledger(tmp_path, beacon, capsys):
    train(tmp_path / "run", beacon.link())
    code, v = cli_json(capsys, "verify", tmp_path / "run", "--challenges", "6", "--nonce", "07", "--allow-weak")
    assert code == 0 and v["verdict"] == "weak" and v["verified"] == 6
    steps = {e["step"] for e in v["ledger"]}
    assert {r["step"] for r in v["results"]} <= steps
    for e in v["ledger"]:
        assert e["start"] <= e["step"] < e["end"] and e["comparison"] == "hash" and not e["earlier"]
    assert v["bound"] == pytest.approx(1 - 0.95 ** 6)


# --- finding 2: several draws of one window ----------------------------------------------------

def _log(key, records: int) -> RunLog:
    log = RunLog()
    log.append({"type": "manifest", "public_key": public_hex(key.public_key()), "task": "x", "n": 1})
    for i in range(1, records):
        log.append({"type": "step", "step": i - 1})
    return log


def test_parallel_heads_extending_one_stamped_head_get_one_draw(either_beacon):
    served = either_beacon
    key = generate_key()
    log = _log(key, 16)
    link = served.link()
    link.stamp(RunLog(log.lines[:1]).sign_head(key), log)
    link.stamp(RunLog(log.lines[:2]).sign_head(key), log)
    run = run_id(log.lines[0]).hex()
    bodies = [{"tree_head": RunLog(log.lines[:n]).sign_head(key).to_json(), "run": run,
               "consistency": [h.hex() for h in log.tree.consistency_proof(2, n)]} for n in range(3, 15)]
    answers = post_heads(served.url, bodies)
    codes = sorted(a.status_code for a in answers)
    # one is stamped; the others are refused: those checked before it committed lost the
    # conditional update (409), those checked after it no longer extend (400), or are older than
    # (409), the last stamped head
    assert codes[0] == 200 and len(codes) == 12 and set(codes[1:]) <= {400, 409}, codes
    assert all("last one stamped" in a.json()["detail"] or "drawn once" in a.json()["detail"]
               for a in answers if a.status_code != 200)
    winner = BeaconStatement.from_json(next(a.json() for a in answers if a.status_code == 200))
    assert winner.prev_size == 2
    info = httpx.get(f"{served.url}/api/beacon/runs/{run}").json()
    assert [s["prev_size"] for s in info["statements"]] == [0, 1, 2]
    assert info["last_size"] == winner.size  # what was stamped, not what was last written


def test_two_heads_of_one_size_raced_in_are_kept_as_equivocation(tmp_path):
    served = Served(f"sqlite:///{tmp_path / 'b.db'}")
    try:
        for trial in range(4):
            key = generate_key()
            honest, fork = _log(key, 6), _log(key, 6)
            fork.lines[-1] = canonical_json({"type": "step", "step": 4, "fork": trial})
            fork = RunLog(fork.lines)
            link = served.link()
            link.stamp(RunLog(honest.lines[:1]).sign_head(key), honest)
            run = run_id(honest.lines[0]).hex()
            bodies = [{"tree_head": log.sign_head(key).to_json(), "run": run,
                       "consistency": [h.hex() for h in log.tree.consistency_proof(1, 6)]} for log in (honest, fork)]
            assert sorted(a.status_code for a in post_heads(served.url, bodies)) == [200, 409]
            info = httpx.get(f"{served.url}/api/beacon/runs/{run}").json()
            assert info["equivocated"] and len(info["evidence"]) == 1  # whichever came second: a fork, kept
    finally:
        served.close()


def test_a_head_of_an_impossible_size_is_refused_not_a_server_error(either_beacon):
    served = either_beacon
    key = generate_key()
    log = _log(key, 3)
    BeaconClient(served.url).stamp(RunLog(log.lines[:1]).sign_head(key), log)
    head = log.sign_head(key).to_json()
    for size in (2**31 + 5, 2**62 + 5, 2**63 + 5, 2**64):
        r = httpx.post(f"{served.url}/api/beacon/heads", json={"tree_head": {**head, "size": size}, "consistency": [],
                                                               "run": run_id(log.lines[0]).hex()})
        assert r.status_code == 400 and "at most 2147483647" in r.json()["detail"], (size, r.text)


def test_a_bundle_with_two_statements_of_one_window_is_rejected(tmp_path, beacon, capsys):
    rec = train(tmp_path / "run", beacon.link())
    sts = statements(tmp_path / "run")
    # what a racing beacon (witness 0.5) signed: a second draw for the window after one stamped head,
    # for another head of the same log
    first = sts[2]
    log = rec.log
    twin = BeaconStatement(beacon.public_key, first.run, first.size + 1, log.root(first.size + 1), first.prev_size,
                           b"\x42" * 32, first.received_ms, False).signed(beacon.key)
    with open(tmp_path / "run" / STATEMENTS, "ab") as f:
        f.write(canonical_json(twin.to_json()) + b"\n")
    capsys.readouterr()
    assert main(["verify", str(tmp_path / "run"), "--mode", "online", "--beacon-key", beacon.public_key]) == 1
    assert "two beacon statements open a window after the head of size" in capsys.readouterr().err


# --- finding 3: restarting until the draw misses -----------------------------------------------

def test_restarts_of_one_computation_are_priced_into_the_bound_whatever_key_or_finish(tmp_path, beacon, capsys):
    from witness.cli.args import trainer_r

    key = generate_key()
    save_key(key, tmp_path / "key.pem")
    r = trainer_r("restart", key)  # what `witness train --seed restart --key key.pem` uses
    # attempts at the presented run's computation (its run seed and training recipe), each under a fresh
    # key: walked away from when the draw selected the bad step, finished (all of them can be: they are
    # one computation), and one that changes only what is observed of the training (the sketch)
    train(tmp_path / "a1", beacon.link(), r=r, stop=22)
    train(tmp_path / "a2", beacon.link(), r=r)
    train(tmp_path / "a3", beacon.link(), r=r, config={"sketch_dims": 9}, stop=22)
    # priced too: the same seed under another recipe (here another learning rate; it could as well be a
    # field that changes no bit of the training). Linked but not priced: a stranger's run of the same
    # recipe under another seed (which anyone could open, to grieve)
    train(tmp_path / "sweep", beacon.link(), r=r, config={"lr": 0.02})
    train(tmp_path / "stranger", beacon.link(), r=b"\x06" * 32, stop=5)
    # the presented run, through the command line
    assert main(["train", "--task", "tiny", "--steps", str(STEPS), "--checkpoint-every", "10", "--key",
                 str(tmp_path / "key.pem"), "--out", str(tmp_path / "run"), "--quiet", "--beacon", beacon.url,
                 "--seed", "restart", "--online-p", str(P), "--online-every", str(EVERY)]) == 0
    final = statements(tmp_path / "run")[-1]
    assert final.final and final.version == 3 and (final.others, final.attempts) == (5, 4)
    code, v = cli_json(capsys, "verify", tmp_path / "run", "--mode", "online", "--beacon-key", beacon.public_key,
                       "--allow-weak")
    assert code == 0 and v["online"]["attempts"] == 4
    b = math.ceil(0.05 * STEPS)
    assert v["bound"] == pytest.approx((1 - (1 - P) ** b) ** 5) == pytest.approx(online_bound(P, 0.05, STEPS, 0, 4))
    capsys.readouterr()
    main(["verify", str(tmp_path / "run"), "--mode", "online", "--beacon-key", beacon.public_key, "--allow-weak"])
    out = capsys.readouterr().out
    assert "linked 5 other run(s) to this one" in out and "prices 4 of them in" in out and "over 5 attempts" in out
    assert "an attempt under another run seed is not seen" in out


def test_variants_of_one_computation_under_an_inert_recipe_field_are_priced(tmp_path, beacon, capsys):
    """The red team's finding: the trainer trains once, then streams the same steps under recipes that
    differ only in a field that changes no bit of the training (a clipping threshold never reached), each
    under a fresh key, and presents the first whose draw missed its bad step. Every run of the seed is
    priced, whatever its recipe."""
    from witness.cli.args import trainer_r

    key = generate_key()
    r = trainer_r("inert", key)  # what `witness train --seed inert --key key.pem` uses
    bad = {32}
    variants = [train(tmp_path / f"v{clip:g}", beacon.link(), r=r, bad=bad, config={"grad_clip": clip}, stop=37)
                for clip in (1000.0, 1001.0, 1002.0)]
    # the variants' step records are byte-identical: one computation, signed under three recipes and keys
    logs = [(tmp_path / f"v{clip:g}" / "log.jsonl").read_bytes().splitlines()[1:30] for clip in (1000.0, 1001.0)]
    assert logs[0] == logs[1] and variants[0].key != variants[1].key
    save_key(key, tmp_path / "key.pem")
    assert main(["train", "--task", "tiny", "--steps", str(STEPS), "--checkpoint-every", "10", "--key",
                 str(tmp_path / "key.pem"), "--out", str(tmp_path / "run"), "--quiet", "--beacon", beacon.url,
                 "--seed", "inert", "--config", "grad_clip=1003.0", "--online-p", str(P), "--online-every",
                 str(EVERY)]) == 0
    final = statements(tmp_path / "run")[-1]
    assert final.final and (final.others, final.attempts) == (3, 3)
    code, v = cli_json(capsys, "verify", tmp_path / "run", "--mode", "online", "--beacon-key", beacon.public_key,
                       "--bad-fraction", str(1 / STEPS), "--allow-weak")
    assert code == 0 and v["online"]["attempts"] == 3
    # one bad step of 40 at p = 0.25: one attempt is caught with probability 0.25, but a trainer that presents
    # the first of four attempts whose draw missed is caught only if all four drew the step: 0.25^4
    assert v["bound"] == pytest.approx(P ** 4) == pytest.approx(online_bound(P, 1 / STEPS, STEPS, 0, 3))


def test_a_stranger_who_guesses_the_seed_text_cannot_open_runs_of_the_run_seed(tmp_path, beacon):
    """``--seed 0`` once made r = H("0"), so anyone could compute the run seed from the public data root
    and open runs of it at the beacon, each priced as an attempt at the honest run (the red team: ten
    such runs took an honest audit from 97 % to weak). r is now the text's under the signing key."""
    from witness.commit.hashing import tagged_hash
    from witness.commit.signing import secret_r

    key = generate_key()
    save_key(key, tmp_path / "key.pem")
    # the stranger's guesses: the old derivation, from the text alone, and the text under a key of its own
    for i, r in enumerate((tagged_hash("witness/trainer-seed/v1", b"0"), secret_r("0", generate_key()))):
        train(tmp_path / f"stranger{i}", beacon.link(), r=r, stop=4, config={"lr": 0.5})
    assert main(["train", "--task", "tiny", "--steps", str(STEPS), "--checkpoint-every", "10", "--key",
                 str(tmp_path / "key.pem"), "--out", str(tmp_path / "run"), "--quiet", "--beacon", beacon.url,
                 "--seed", "0", "--online-p", str(P), "--online-every", str(EVERY)]) == 0
    final = statements(tmp_path / "run")[-1]
    assert final.final and (final.others, final.attempts) == (0, 0)  # no key, recipe or seed in common
    m = parse_canonical_json((tmp_path / "run" / "log.jsonl").read_bytes().splitlines()[0])
    assert bytes.fromhex(m["r"]) == secret_r("0", key)  # the same text and key give the same r


def test_a_final_statement_counted_under_the_old_rule_is_read_as_unknown(tmp_path, beacon, capsys):
    """A beacon of witness 0.6 or 0.7 signed version 2 final statements, which priced only the runs of
    the same seed and recipe (the red team ran the inert-field restarts through one: attempts 0). A
    verifier cannot tell which rule counted a version 2 count, so it reads it as unknown: bound 0."""
    train(tmp_path / "run", beacon.link())
    path = tmp_path / "run" / STATEMENTS
    lines = path.read_bytes().splitlines()
    final = BeaconStatement.from_json(parse_canonical_json(lines[-1]))
    assert final.final and final.version == 3
    old = dataclasses.replace(final, version=2).signed(beacon.key)  # what the old beacon signed
    path.write_bytes(b"".join(x + b"\n" for x in lines[:-1]) + canonical_json(old.to_json()) + b"\n")
    code, v = cli_json(capsys, "verify", tmp_path / "run", "--mode", "online", "--beacon-key", beacon.public_key)
    assert code == 3 and v["accepted"] and v["bound"] == 0.0 and v["online"]["attempts"] is None
    assert "version 2" in v["online"]["uncounted"] and "version 2" in v["warning"]


class FixedStart(GenericTask):
    """A fine-tune from fixed weights (the model ignores the run seed), every batch the whole dataset:
    under any run seed it trains the same steps, so another seed is no other computation."""

    name = "fixed-start-test"

    def make_model(self):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)  # the pretrained weights it starts from, whatever the run seed
            return torch.nn.Linear(4, 2)

    def make_dataset(self):
        x = torch.randn(16, 4, generator=torch.Generator().manual_seed(1))
        return [{"x": x[i], "y": (x[i, 0] > 0).long()} for i in range(16)]


class FixedStartDropout(FixedStart):
    """The same, with dropout: its masks come from the step's seed, so another seed is other steps."""

    name = "fixed-start-dropout-test"

    def make_model(self):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            return torch.nn.Sequential(torch.nn.Dropout(0.1), torch.nn.Linear(4, 2))


@pytest.mark.parametrize("cls,batch", [(FixedStart, 16), (FixedStart, 8), (FixedStartDropout, 16)])
def test_restarts_under_other_seeds_that_train_the_same_steps_are_not_priced_as_if_they_cost(tmp_path, beacon,
                                                                                           capsys, cls, batch):
    """The red team: a task from fixed weights whose batch is the whole dataset trains the same steps
    under every run seed, so each fresh seed is an unpriced draw. The verifier sees it (the initial state
    under a second seed, the batches as sets, a step's loss on the probes under two step seeds): the
    bound is then 0, and says why. With half the dataset a batch another seed trains on other samples,
    and with dropout it draws other masks: priced as before."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(registry.BUILTIN, cls.name, cls)  # as a plugin would register it
        registry._built.cache_clear()
        try:
            task = build_task(cls.name, {"steps": STEPS, "batch_size": batch})
            train(tmp_path / "run", beacon.link(), task=task)
            code, v = cli_json(capsys, "verify", tmp_path / "run", "--mode", "online", "--beacon-key",
                               beacon.public_key)
        finally:
            registry._built.cache_clear()
    if cls is FixedStart and batch == 16:
        assert code == 3 and v["accepted"] and v["bound"] == 0.0 and v["online"]["attempts"] is None
        assert "does not depend on the run seed" in v["online"]["uncounted"] and "bound is 0" in v["warning"]
    else:
        assert v["online"]["attempts"] == 0 and v["online"]["uncounted"] is None and v["bound"] > 0


def test_a_head_that_calls_an_abandoned_attempt_finished_does_not_unprice_it(tmp_path, beacon):
    from witness.cli.args import trainer_r

    r = trainer_r("fake-finish", generate_key())
    rec = train(tmp_path / "a", beacon.link(), r=r, stop=22)
    # the trainer signs a head for one made-up record whose extensions say the run ended
    rec.log.append({"type": "end", "made": "up"})
    link = beacon.link()
    link.statements(rec.log)  # where the beacon stands for this run
    fake = rec.log.sign_head(rec.key, extensions={"final_state_hash": "00" * 32})
    assert link.stamp(fake, rec.log).final
    train(tmp_path / "run", beacon.link(), r=r)
    assert statements(tmp_path / "run")[-1].attempts == 1


# --- finding 4: accepted with a bound of 0 ----------------------------------------------------

def test_a_bundle_that_leaves_out_its_last_statements_does_not_exit_0(tmp_path, beacon, capsys):
    train(tmp_path / "run", beacon.link())
    path = tmp_path / "run" / STATEMENTS
    path.write_bytes(b"".join(line + b"\n" for line in path.read_bytes().splitlines()[:-2]))
    args = ["verify", str(tmp_path / "run"), "--mode", "online", "--beacon-key", beacon.public_key]
    capsys.readouterr()
    assert main(args) == 3
    assert "WEAK" in capsys.readouterr().err
    code, v = cli_json(capsys, *args)
    assert code == 3 and v["verdict"] == "weak" and v["accepted"] and v["bound"] == 0.0
    assert v["online"]["attempts"] is None and "other attempts unknown" in v["online"]["linking"]
    assert main([*args, "--allow-weak"]) == 0
    # an honest audit that reaches the confidence asked for exits 0 without it
    assert main(["verify", str(tmp_path / "run"), "--challenges", str(STEPS)]) == 0


# --- finding 5: the data root named, and what it was checked against ----------------------------

class OtherTeacher:
    """A ``tiny`` recipe trained on another teacher's samples (a task object the trainer made)."""

    def __new__(cls, steps: int):
        from witness.data.synthetic import SyntheticClassification
        from witness.task.registry import task_class

        task = task_class("tiny").from_config({"steps": steps})  # its own object: build_task's are shared
        c = task.config
        other = SyntheticClassification(c.dataset_size, c.features, c.classes, seed=b"another teacher")
        task.__dict__["_dataset"] = other  # the cached dataset the recorder reads
        return task


def test_a_cheap_audit_rejects_a_synthetic_task_trained_on_other_data(tmp_path, beacon, capsys):
    train(tmp_path / "run", beacon.link(), task=OtherTeacher(STEPS))
    capsys.readouterr()
    assert main(["verify", str(tmp_path / "run"), "--mode", "online", "--beacon-key", beacon.public_key,
                 "--allow-weak"]) == 1
    assert "it trained on other data" in capsys.readouterr().err


def test_every_verdict_names_the_data_root_and_what_it_was_checked_against(tmp_path, beacon, capsys):
    train(tmp_path / "run", beacon.link())
    root = json.loads((tmp_path / "run" / "log.jsonl").read_text().split("\n")[0])["data_root"]
    online = ["verify", tmp_path / "run", "--mode", "online", "--beacon-key", beacon.public_key, "--allow-weak"]
    code, v = cli_json(capsys, *online)
    assert code == 0 and v["data_root"] == root and "generates from its recipe (rebuilt here)" in v["data_checked"], v
    code, v = cli_json(capsys, *online, "--data-root", root)
    assert code == 0 and v["data_checked"] == "the data root the verifier named (--data-root)"
    code, v = cli_json(capsys, *online, "--data-root", "ab" * 32)
    assert code == 1 and "not on the data root" in " ".join(v["failures"])
    code, v = cli_json(capsys, "verify", tmp_path / "run", "--challenges", "2", "--allow-weak")
    assert code == 0 and v["data_checked"].startswith("the dataset here")
    # a task whose data the verifier does not hold: the root is the trainer's word, and the verdict says so
    from witness.verify.verdict import Verdict

    text = Verdict(True, "interactive", True, "x", 1, True, "s", 1, 0.05, 1.0, "", data_root=root).summary()
    assert "taken on the trainer's word" in text and root[:16] in text


# --- finding 6: online uploads to the leaderboard are taken once ---------------------------------

@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_parallel_online_uploads_of_one_step_keep_one_object(tmp_path, backend):
    from lbhelpers import Authed, make_settings, register
    from sqlalchemy import select

    from witness.leaderboard import client as C
    from witness.leaderboard.app import create_app as leaderboard_app
    from witness.leaderboard.db import OnlineStep
    from witness.leaderboard.service import Leaderboard
    from witness.leaderboard.tracks import parse_track
    from witness.store import online_prefix

    class Quiet(C.LeaderboardBeacon):
        publish = None  # this trainer uploads nothing itself: the test races the uploads

    lb = Leaderboard(make_settings(backend, tmp_path, tracks=(parse_track("all=tiny:steps=12,online=1.0@accuracy+"),)))
    server, thread, url = start_uvicorn(leaderboard_app(lb=lb))
    try:
        with httpx.Client(base_url=url, timeout=60) as http:
            alice, eve = register(http, "alice"), register(http, "eve")
            a = Authed(http, alice.token)
            tk = C.ticket(a, "all")
            task = build_task(tk["task"], tk["config"])
            rec = Recorder.create(task, tmp_path / "run", alice.key, r=bytes.fromhex(tk["r"]),
                                  commit=Commitments(checkpoint_every=4, r_source="ticket"),
                                  online=Online(beacon=Quiet(a, tk["run_id"]), spec=OnlineSpec.for_steps(12, p=1.0)),
                                  self_check=SelfChecking(enabled=False))
            for t in range(6):
                rec.log_step(t, task.train_step(rec.model, rec.optimizer, rec.batch(t), rec.lr(t), rec.step_seed(t)))
            rec.online.wait()
        run = tk["run_id"]
        state = (tmp_path / "run" / "online" / "states" / "00000001.safetensors").read_bytes()
        put = f"/api/runs/{run}/online/states/1"
        # another account's upload is refused before a byte of it is stored
        with httpx.Client(base_url=url, timeout=60) as http:
            assert http.put(put, content=b"\0" * 100_000, headers=Authed(http, eve.token).headers).status_code == 403
        assert not list((lb.store.root / "incoming").glob("upload-*"))

        def race(bodies: list[bytes]) -> list[int]:
            def one(body: bytes) -> int:
                with httpx.Client(base_url=url, timeout=60) as http:
                    return http.put(put, content=body, headers=Authed(http, alice.token).headers).status_code

            return sorted(at_once(one, bodies))

        assert race([state] * 8) == [201] + [409] * 7
        put = f"/api/runs/{run}/online/states/2"
        assert race([state + bytes([i]) for i in range(7)]) == [201] + [409] * 6  # different bytes
        kept = [k for k, _ in lb.store.keys(online_prefix(run, "states"))]
        with lb.Session() as s:
            named = {r.step: r.state_sha256 for r in s.scalars(select(OnlineStep).where(OnlineStep.run_id == run))}
        # one object per step, each the one its row names: none orphaned
        assert sorted(kept) == sorted(k for k in kept if any(named[st] and named[st] in k for st in (1, 2)))
        assert len([k for k in kept if "/00000002." in k]) == 1 and len([k for k in kept if "/00000001." in k]) == 1
        rec.online.close()
    finally:
        stop_uvicorn(server, thread)
        lb.engine.dispose()

