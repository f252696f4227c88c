"""Contest tracks (issue 51): a track fixes the data, the evaluation and a budget; two accounts bring two
methods (wheels), three seeds each, every run replayed in the sandbox and scored blind by the server, and
the page ranks the methods and says whether the difference is significant. Then what a dishonest
submitter tries: a method over the budget, one changed after its ticket, a run that grows past the budget
after its method was admitted, a method that reports its score instead of computing it, and one that
reaches for the server's files from inside the sandbox."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from contest_helpers import TRACK, install, method, train_and_submit, witness
from cryptography.hazmat.primitives import serialization
from lbhelpers import QUICK, make_settings, register

from witness.evals.certificate import check_certificate
from witness.leaderboard import views
from witness.leaderboard.app import create_app
from witness.leaderboard.db import Track
from witness.leaderboard.ranking import ALPHA, welch_p
from witness.leaderboard.recovery import recover
from witness.leaderboard.service import Leaderboard
from witness.leaderboard.tracks import parse_track
from witness.leaderboard.worker import work
from witness.methods.contest import Budget
from witness.task.registry import build_task
from witness.web import start_uvicorn, stop_uvicorn


@pytest.fixture(scope="module")
def board(tmp_path_factory):
    """A live leaderboard with the contest track (and a track of one recipe), and a client of it."""
    tmp = tmp_path_factory.mktemp("contest")
    lb = Leaderboard(make_settings("sqlite", tmp, tracks=(parse_track(TRACK), parse_track(QUICK)),
                                     registrations_per_hour=100))
    server, thread, url = start_uvicorn(create_app(lb=lb))
    with httpx.Client(base_url=url, timeout=300) as c:
        yield lb, c, url, tmp
    stop_uvicorn(server, thread)
    lb.engine.dispose()


def test_a_contest_track_states_a_budget_and_refuses_what_it_cannot_score():
    t = parse_track("golf=tiny:max_steps=12,max_samples=100,seeds=3@accuracy+")
    assert t.budget == Budget(max_steps=12, max_samples=100) and t.config == {}
    assert json.loads(t.resolve()["contest_json"]) == {"max_steps": 12, "max_samples": 100, "max_tokens": None, "max_params": None}
    assert parse_track(QUICK).budget is None and parse_track(QUICK).resolve()["contest_json"] is None
    assert Budget(max_steps=5).breaches(6, 1, 1, 1) == ["6 steps, over the track's budget of 5"]
    assert Budget(max_params=10).breaches(10**6, 10**9, 10**9, 10) == []
    for bad, why in (("g=tiny:max_steps=12,online=0.5@accuracy+", "online audits of submitted methods"),
                     ("g=tinygpt:max_steps=12@bits_per_byte-", "cannot hide its targets"),
                     ("g=tiny:max_steps=0@accuracy+", "positive whole number"),
                     ("g=tiny:max_params=abc@accuracy+", "positive whole number")):
        with pytest.raises(ValueError, match=why):
            parse_track(bad)


class Entrant:
    """A registered account, its key on disk, and where it trains."""

    def __init__(self, board, name: str):
        lb, self.client, self.url, tmp = board
        self.lb, self.home = lb, tmp / name
        self.home.mkdir()
        t = register(self.client, name)
        self.token, self.auth = t.token, {"Authorization": f"Bearer {t.token}"}
        self.key = self.home / "key.pem"
        self.key.write_bytes(t.key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                 serialization.NoEncryption()))

    def admit(self, wheel: bytes, name: str | None = None, track: str = "golf") -> httpx.Response:
        """Submit a method."""
        return self.client.post(f"/api/tracks/{track}/methods", content=wheel, headers=self.auth,
                                params={"name": name} if name else {})

    def submitted(self, wheel: bytes, method_id: int, label: str) -> int:
        """Train one run of the method (its wheel installed only in the trainer's process) and submit it."""
        env = install(wheel, self.home / f"site-{label}")
        out = train_and_submit(env, self.url, self.token, self.key, method_id, self.home / label)
        return int(out.stdout.split("submitted run ")[1].split(":")[0])

    def run(self, wheel: bytes, method_id: int, label: str) -> dict:
        """A run of the method, submitted and decided by a worker; the run as the API shows it."""
        run_id = self.submitted(wheel, method_id, label)
        assert work(self.lb, once=True) == 1
        return self.client.get(f"/api/runs/{run_id}").json()


LEARNS_NOTHING = """
def build_model(self, seed):
    model = super().build_model(seed)
    with torch.no_grad():
        model.fc2.weight.zero_()
        model.fc2.bias.zero_()
    return model
"""


def test_two_accounts_two_methods_three_seeds_each_certified_and_ranked(board):
    lb, c, _, _ = board
    alice, bob = Entrant(board, "alice"), Entrant(board, "bob")
    # the slow method learns nothing (a zero last layer and no steps' worth of rate): it scores the same on every
    # seed, so the test never hangs on how three seeds of a near-chance model happen to spread
    wide, slow = method(hidden=16, lr=0.05), method(hidden=8, lr=0.0, extra=LEARNS_NOTHING)
    a = alice.admit(wide, "wide-and-fast")
    b = bob.admit(slow, "narrow-and-slow")
    assert a.status_code == 201 and b.status_code == 201, (a.text, b.text)
    assert alice.admit(wide).status_code == 200  # the same files again: the method admitted before
    ma, mb = a.json(), b.json()
    assert ma["steps"] == 12 and ma["params"] == 8 * 16 + 16 + 16 * 4 + 4 and mb["params"] == 8 * 8 + 8 + 8 * 4 + 4
    runs = [bob.run(slow, mb["id"], f"b{i}") for i in range(3)] + [alice.run(wide, ma["id"], f"a{i}") for i in range(3)]
    for r in runs:
        assert r["status"] == "certified", r["reason"]
        assert r["bound"] == 1.0 and r["verdict"]["challenges"] == 12  # every step replayed, in the sandbox
        assert any("ran only in the sandbox" in line for line in r["verdict"]["checks"])
        assert any(line.startswith("within the track's budget, by what the run committed: 12 steps, 192 training samples, "
                               "1,728 tokens")
                   for line in r["verdict"]["checks"])
        assert "targets hidden from the method" in r["contamination"]
        # the evaluation is the server's own, signed by it, every aggregate recomputable from its examples
        cert = json.loads(c.get(f"/runs/{r['id']}/download/evaluation.json").content)
        checked = check_certificate(cert, build_task("tiny", {}).aggregates, evaluator=lb.public_key)
        assert checked["aggregates"]["accuracy"] == r["metric_value"] and checked["eval_size"] == 256
    with lb.Session() as s:
        entries = {e.method: e for e in views.methods(s, s.get(Track, "golf"))}
    wide_e, slow_e = entries[f"wide-and-fast (#{ma['id']}, alice)"], entries[f"narrow-and-slow (#{mb['id']}, bob)"]
    assert wide_e.ranked and slow_e.ranked and len(wide_e.seeds) == len(slow_e.seeds) == 3
    assert slow_e.verdict.startswith("baseline")  # ranked first: the track's baseline
    p = welch_p([x.value for x in wide_e.seeds], [x.value for x in slow_e.seeds], higher_is_better=True)
    assert wide_e.p_value == pytest.approx(p) and wide_e.record == (p < ALPHA)
    assert len({x.value for x in slow_e.seeds}) == 1  # always the first class
    assert wide_e.mean > slow_e.mean and p < ALPHA, [x.value for x in wide_e.seeds]  # about 0.75 against chance
    page = c.get("/tracks/golf").text
    for e in (wide_e, slow_e):
        assert f">{views.number(e.mean)}<" in page and e.method in page  # as the page writes figures: 4 digits
    assert "improvement over narrow-and-slow" in page and "Welch" in page
    assert "at most 12 steps, 2,000 tokens, 2,000 parameters" in page  # the budget, not a recipe
    # the board's own log holds every decision
    decisions = [json.loads(x) for x in c.get("/api/board/entries").json()["entries"]]
    assert sorted(d["run"] for d in decisions if d["decision"] == "certified") == sorted(r["id"] for r in runs)


def test_a_method_over_the_budget_is_refused_before_it_trains(board):
    carol = Entrant(board, "carol")
    long = carol.admit(method(steps=20))
    assert long.status_code == 400 and "20 steps, over the track's budget of 12" in long.json()["detail"]
    big = carol.admit(method(hidden=256))
    assert big.status_code == 400 and "3,332 parameters, over the track's budget of 2,000" in big.json()["detail"]
    fat = carol.admit(method(fields="batch_size: int = 32"))  # 384 samples of 9 bytes
    assert fat.status_code == 400 and "3,456 tokens, over the track's budget of 2,000" in fat.json()["detail"]
    elsewhere = carol.admit(method(fields="dataset_size: int = 512"))
    assert elsewhere.status_code == 400 and "other data than the track's" in elsewhere.json()["detail"]
    junk = carol.admit(b"PK\x03\x04 not a wheel")
    assert junk.status_code == 400 and "the wheel" in junk.json()["detail"]
    assert [m["account"] for m in carol.client.get("/api/tracks/golf/methods").json()].count("carol") == 0


def test_a_ticket_names_ones_own_method_on_a_contest_track_only(board):
    lb, c, _, _ = board
    dave, erin = Entrant(board, "dave"), Entrant(board, "erin")
    m = dave.admit(method(lr=0.04)).json()
    assert c.post("/api/tickets", json={"track": "golf"}, headers=dave.auth).status_code == 400
    assert c.post("/api/tickets", json={"track": "golf", "method": m["id"]}, headers=erin.auth).status_code == 403
    assert c.post("/api/tickets", json={"track": "quick", "method": m["id"]}, headers=dave.auth).status_code == 400
    assert dave.admit(method(), track="quick").status_code == 400  # a track of one recipe takes no method
    tk = c.post("/api/tickets", json={"track": "golf", "method": m["id"]}, headers=dave.auth).json()
    assert tk["method"]["task_source"] == m["task_source"] and tk["contest"]["max_steps"] == 12
    wheel = c.get(m["wheel"])  # anyone can read the code of a method on the board
    assert wheel.status_code == 200 and wheel.content[:2] == b"PK"


def test_a_method_changed_after_its_ticket_is_refused(board):
    frank = Entrant(board, "frank")
    admitted = method(lr=0.03)
    wheel = frank.home / "frank_mlp-1.0-py3-none-any.whl"
    wheel.write_bytes(admitted)
    env = {**install(admitted, frank.home / "admitted"), "WITNESS_LEADERBOARD_TOKEN": frank.token}
    said = witness(env, "leaderboard", "method", str(wheel), "--leaderboard", frank.url, "--track", "golf", "--json",
                   cwd=frank.home)
    m = json.loads(said.stdout)
    assert m["params"] == 212 and m["account"] == "frank"
    changed = method(lr=0.03, extra="def train_step(self, *a, **kw):\n    return super().train_step(*a, **kw)\n")
    env = {**install(changed, frank.home / "site"), "WITNESS_LEADERBOARD_TOKEN": frank.token}
    done = witness(env, "train", "--leaderboard", frank.url, "--track", "golf", "--method", str(m["id"]), "--key",
                   str(frank.key), "--out", str(frank.home / "run"), "--quiet", cwd=frank.home, check=False)
    assert done.returncode != 0 and "a method changed after its ticket is not the one admitted" in done.stderr


GROWS = '''
def build_model(self, seed):
    model = super().build_model(seed)
    if seed != bytes(32):  # admitted with the zero seed; every real run is larger
        model.extra = torch.nn.Parameter(torch.zeros(5000))
    return model
'''


def test_a_run_that_grows_past_the_budget_after_admission_is_rejected(board):
    gina = Entrant(board, "gina")
    wheel = method(extra=GROWS)
    m = gina.admit(wheel).json()
    assert m["params"] == 212  # what the sandbox saw at admission
    r = gina.run(wheel, m["id"], "run")
    assert r["status"] == "rejected" and "5,212 parameters, over the track's budget of 2,000" in r["reason"]


PEEKS = '''
def probe_outputs(self, model, probes):
    """Its 'logits': the label it was given, read back (a perfect score, if it were scored on its own word)."""
    return torch.nn.functional.one_hot(probes[1], self.config.classes).float() * 100 + 0 * model(probes[0])
'''


def test_a_method_is_scored_blind_and_cannot_report_its_own_score(board, monkeypatch):
    from witness import sandbox

    hank = Entrant(board, "hank")
    wheel = method(extra=PEEKS)
    run_id = hank.submitted(wheel, hank.admit(wheel).json()["id"], "run")

    def no_bwrap(*a, **kw):
        raise sandbox.SandboxError("bubblewrap (bwrap) is not installed")

    with monkeypatch.context() as m:  # a worker that cannot make the sandbox decides nothing
        m.setattr(sandbox.Conversation, "__init__", no_bwrap)
        work(hank.lb, once=True)
    r = hank.client.get(f"/api/runs/{run_id}").json()
    assert r["status"] == "pending" and "cannot run the method" in r["reason"] and r["certification"] is None
    assert recover(hank.lb).certifications_requeued == 1  # the server's next start certifies it again
    assert work(hank.lb, once=True) == 1  # with a worker that can
    r = hank.client.get(f"/api/runs/{run_id}").json()
    assert r["status"] == "certified", r["reason"]  # it trained as it recorded: replay agrees
    ev = build_task("tiny", {}).eval_dataset()
    zeros = sum(ev.sample_bytes(i)[8] == 0 for i in range(len(ev))) / len(ev)
    assert r["metric_value"] == zeros < 0.5  # every hidden label reads 0: its "perfect" outputs score chance


def test_a_method_reaching_for_the_servers_files_is_rejected_and_the_server_goes_on(board):
    lb, c, _, tmp = board
    ivan = Entrant(board, "ivan")
    db = Path(lb.settings.db_url.removeprefix("sqlite:///"))
    evil = f'''
def train_step(self, *a, **kw):
    if in_sandbox():
        open({str(db)!r}, "rb").read()  # the server's database: not there to read
    return super().train_step(*a, **kw)
'''
    wheel = method(extra=evil)
    r = ivan.run(wheel, ivan.admit(wheel).json()["id"], "run")
    assert r["status"] == "rejected" and "FileNotFoundError" in r["reason"]
    assert c.get("/api/tracks").status_code == 200 and db.stat().st_size > 0


def test_the_contest_page_in_chromium_shows_the_budget_and_links_each_methods_code(board):
    from playwright.sync_api import sync_playwright
    from test_leaderboard_browser import CHROMIUM, FLAGS, SCREEN

    lb, c, url, _ = board
    judy = Entrant(board, "judy")
    m = judy.admit(method(lr=0.02), "judys-mlp").json()
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        page = browser.new_page(viewport=SCREEN)
        page.goto(f"{url}/tracks/golf")
        assert "at most 12 steps, 2,000 tokens, 2,000 parameters" in page.locator("#contest").inner_text()
        row = page.locator("tr.submitted-method", has_text="judys-mlp")
        assert row.count() == 1 and m["task_source"]["files_sha256"][:16] in row.inner_text()
        assert "212" in row.inner_text()  # its parameters, as the sandbox counted them
        with page.expect_download() as dl:
            row.locator("a", has_text="wheel").click()
        assert open(dl.value.path(), "rb").read() == c.get(m["wheel"]).content
        assert page.locator("#methods").count() == 1 and "a method is a submitted wheel" in page.content()
        page.goto(f"{url}/tracks/quick")  # a track of one recipe: no contest, no submitted methods
        assert page.locator("#contest").count() == 0 and page.locator("#submitted").count() == 0
        browser.close()


@pytest.mark.parametrize("attack", ["forks without end"])  # (each attack: test_method_sandbox)
def test_a_hostile_method_is_rejected_by_the_worker_and_the_board_goes_on(board, attack, monkeypatch):
    import textwrap

    from test_method_sandbox import ATTACKS

    from witness.methods import process

    monkeypatch.setattr(process, "STEP_SECONDS", 5.0)  # a hang costs one step's limit
    lb, c, _, _ = board
    who = Entrant(board, "mallory-" + attack.split()[0])
    code, reason = ATTACKS[attack]
    wheel = method(extra="def train_step(self, *a, **kw):\n    if in_sandbox():\n"
                   + textwrap.indent(textwrap.dedent(code), "        ") + "    return super().train_step(*a, **kw)\n")
    r = who.run(wheel, who.admit(wheel).json()["id"], "run")  # (it trains honestly on its own machine)
    assert r["status"] == "rejected" and reason in r["reason"], r["reason"]
    assert c.get("/api/tracks/golf").status_code == 200 and work(lb, once=True) == 0  # serving, nothing stuck



F8 = '''
import sys as _sys
_main = _sys.modules.get("__main__")
if _main is not None and hasattr(_main, "Child"):  # only in the sandbox's child
    def _outputs(self, payload):
        n = len(_main.read_samples(payload))
        _main.write_state(_main.SCRATCH, {"outputs": torch.zeros(n, 4).to(torch.float8_e4m3fn)}, 0, sync=False)
        return {}, _main.SCRATCH.read_bytes()
    _main.Child.outputs = _outputs
'''

SHADOW_TOP = '''
import sys as _sys
_main = _sys.modules.get("__main__")
if _main is not None and hasattr(_main, "Child"):  # only in the sandbox's child: one more "tied" group
    _orig = _main.alias_groups
    _main.alias_groups = lambda model: [*_orig(model), ("model.fc2.bias", "optim.fc2.bias.shadow")]


class Shadow(torch.optim.SGD):
    """SGD that keeps a copy of every parameter in its state (so the lying group holds in every state)."""

    def __init__(self, params, lr):
        super().__init__(params, lr=lr)
        self._shadow()

    def _shadow(self):
        for g in self.param_groups:
            for p in g["params"]:
                self.state[p]["shadow"] = p.detach().clone()

    def step(self, closure=None):
        out = super().step(closure)
        self._shadow()
        return out
'''

SHADOW = '''
def build_optimizer(self, model):
    return Shadow(model.parameters(), lr=self.config.lr)
'''

PACKED = '''
def build_model(self, seed):
    return Packed(super().build_model(seed))

def train_step(self, model, optimizer, batch, lr, seed, clip=None):
    for g in optimizer.param_groups:
        g["lr"] = lr
    optimizer.zero_grad(set_to_none=True)
    w = model.packed.view(torch.float32).clone().requires_grad_(True)
    model.live = w
    x, y = batch
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    model.live = None
    gn = float(w.grad.norm())
    with torch.no_grad():
        model.packed.copy_((w - 20 * lr * w.grad).detach().view(torch.float64))
    optimizer.step()
    return StepOutput(float(loss.detach()), lr, gn)
'''

PACKED_TOP = '''
from witness.task.base import StepOutput


class Packed(torch.nn.Module):
    """An MLP of 3,332 float32 weights kept two to a float64 "number": 1,666 of them, and one scale."""

    def __init__(self, mlp):
        super().__init__()
        self.shapes = [p.shape for p in mlp.parameters()]
        flat = torch.cat([p.detach().reshape(-1) for p in mlp.parameters()])
        self.register_buffer("packed", flat.view(torch.float64).clone())
        self.scale = torch.nn.Parameter(torch.ones(()))
        self.live = None

    def forward(self, x, generator=None):
        flat = self.live if self.live is not None else self.packed.view(torch.float32)
        ws, at = [], 0
        for s in self.shapes:
            n = s.numel()
            ws.append(flat[at:at + n].reshape(s))
            at += n
        w1, b1, w2, b2 = ws
        return torch.nn.functional.linear(torch.nn.functional.gelu(torch.nn.functional.linear(x, w1, b1)), w2, b2) * self.scale
'''


def test_outputs_in_another_dtype_reject_the_run(board):
    nia = Entrant(board, "nia")
    wheel = method(top=F8)  # float8 logits: the scoring's own arithmetic would fail on them
    r = nia.run(wheel, nia.admit(wheel).json()["id"], "run")
    assert r["status"] == "rejected" and "float32, float64, float16 or bfloat16" in r["reason"], r["reason"]


def test_tied_weights_the_model_does_not_have_reject_the_run_and_no_score_is_published(board):
    ola = Entrant(board, "ola")
    wheel = method(top=SHADOW_TOP, extra=SHADOW)  # "tied" to a copy it keeps in its optimizer's state
    r = ola.run(wheel, ola.admit(wheel).json()["id"], "run")
    assert r["status"] == "rejected" and "tied weights that are not its model's" in r["reason"], r["reason"]
    assert ola.client.get(f"/runs/{r['id']}/download/evaluation.json").status_code == 404
    assert recover(ola.lb).certifications_requeued == 0  # decided: nothing to certify again


def test_numbers_packed_into_wider_elements_count_by_their_bytes(board):
    pia = Entrant(board, "pia")
    a = pia.admit(method(hidden=256, top=PACKED_TOP, extra=PACKED))  # 3,332 float32 weights in 1,666 float64
    assert a.status_code == 400 and "3,333 parameters, over the track's budget of 2,000" in a.json()["detail"]


def test_admissions_are_counted_refused_or_not_and_one_method_sandbox_runs_on_a_host(board, monkeypatch):
    from methods_helpers import wheel_bytes

    from witness.leaderboard import contests
    from witness.methods.process import MethodSandbox
    from witness.methods.wheel import read_wheel

    rae = Entrant(board, "rae")
    long = wheel_bytes("", version="1.0+" + "a" * 70)  # a valid version, longer than the pin's column
    assert rae.admit(long).status_code == 400 and "version 64" in rae.admit(long).json()["detail"]
    monkeypatch.setattr(contests, "METHODS_PER_HOUR", 2)
    assert [rae.admit(method(steps=13 + i)).status_code for i in range(2)] == [400, 400]  # each ran the sandbox
    assert rae.admit(method(lr=0.011)).status_code == 429  # refused ones count
    sam = Entrant(board, "sam")
    with MethodSandbox(read_wheel(method(lr=0.012)), "sandboxed-mlp", 1):  # an audit running on this host
        busy = sam.admit(method(lr=0.013))
    assert busy.status_code == 503 and "another submitted method's sandbox" in busy.json()["detail"]
    assert sam.admit(method(lr=0.013)).status_code == 201  # once it is done
