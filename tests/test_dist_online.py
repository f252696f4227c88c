"""Online challenges under `torchrun --nproc_per_node=2` (gloo, CPU), DDP and FSDP2: one log and one
draw per window, every rank keeping and writing its own share of each state, one process verifying.
Each attack is what a dishonest trainer can do to the shares: withhold one, swap one for another
state's, mix two runs' shares, change a share so the joined state is not the committed one."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_dist import launch, torchrun
from test_witnessed import Loopback

from witness.beacon.app import create_app
from witness.bundle.layout import LOG, online_shard_name, online_state_name
from witness.bundle.reader import open_bundle
from witness.bundle.state import state_hash
from witness.cli import main
from witness.commit.beacon import selected
from witness.commit.chunks import chunk_indices
from witness.commit.signing import generate_key, public_hex, save_key
from witness.errors import MalformedInput, RunRejected, VerificationError
from witness.fingerprint.chunks import ChunkLayout
from witness.task import build_task
from witness.verify import Policy, Trust, Verifier
from witness.verify.kept import join_shares
from witness.web import start_uvicorn, stop_uvicorn

pytestmark = pytest.mark.filterwarnings("ignore::ResourceWarning")


STEPS, P = 12, 0.25  # the worker's steps and selection probability
# selected steps whose kept states the online audit loads from the ranks' shares (none is a checkpoint's, at
# 4 and 8, and the step before each is not selected: replay would go on from it without loading the state)
SELECTED = {2, 6, 10}
# a step after whose update rank 1 swaps other weights into its rows (not selected: replay never sees it), and
# the first of rank 1's chunks: tiny's parameters over 2 ranks are 2 subtrees of 4 chunks (1 KiB each)
SWAP, RANK1 = 4, 4


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("dist_online")
    key = d / "key.pem"
    save_key(generate_key(), key)
    bkey = generate_key()
    app = create_app(f"sqlite:///{d / 'beacon.db'}", bkey)

    def draw(prev_size: int, size: int) -> bytes:  # betas that select exactly the steps in SELECTED, and
        window = range(max(prev_size - 1, 0), max(min(size - 1, STEPS), 0))  # open one of rank 1's chunks
        while True:                                                           # where a step's weights are swapped
            beta = os.urandom(32)
            if all(selected(beta, t, P) == (t in SELECTED) for t in window) and \
                    (SWAP not in window or any(c >= RANK1 for c in chunk_indices(beta, 2, 2 * RANK1))):
                return beta

    app.state.beacon.draw = draw
    server, thread, url = start_uvicorn(app)
    (d / "loop").mkdir()
    loop = Loopback(d / "loop")
    witnessed = ["--online-every", "6", "--online-p", "1"]  # every step selected: shares of every state kept
    for u in loop.urls:
        witnessed += ["--witness", u]
    witnessed += ["--drand", loop.drand_url, "--drand-chain", str(loop.info), "--seed-hex", "17" * 32]
    swap = ["--seed-hex", "5a" * 32]
    try:
        yield {
            "ddp": torchrun(d / "ddp", key, "ddp", "--beacon", url, "--report", str(d / "ddp.cost")),
            "fsdp": torchrun(d / "fsdp", key, "fsdp", "--beacon", url),
            # (another seed: the same manifest again would be the same run to the beacon, its heads a fork)
            "ddp_swap": torchrun(d / "ddp_swap", key, "ddp", "--beacon", url, "--swap-step", str(SWAP), *swap),
            "fsdp_swap": torchrun(d / "fsdp_swap", key, "fsdp", "--beacon", url, "--swap-step", str(SWAP), *swap),
            # WITNESS_BEACON puts a torchrun script online as it does one process, at the default settings
            "env": example(d / "env", key, url),
            "ddp_witnessed": torchrun(d / "ddp_w", key, "ddp", *witnessed),
            "fsdp_witnessed": torchrun(d / "fsdp_w", key, "fsdp", *witnessed),
            "beacon": public_hex(bkey.public_key()), "loop": loop, "dir": d, "key": key, "url": url,
        }
    finally:
        loop.close()
        stop_uvicorn(server, thread)


def example(out: Path, key: Path, url: str) -> Path:
    """``examples/torchrun_train.py``, unchanged, on 2 ranks with ``WITNESS_BEACON`` set."""
    res = launch(out, key, "fsdp", "--steps", "4", "--batch-size", "4", "--checkpoint-every", "2",
                 env={"WITNESS_BEACON": url}, script=Path(__file__).parents[1] / "examples" / "torchrun_train.py")
    assert res.returncode == 0, res.stderr[-3000:]
    return out


def online(bundle: Path, beacon: str):
    return Verifier(Trust(beacon_key=beacon), Policy(mode="online")).verify(bundle)


@pytest.mark.parametrize("parallelism", ["ddp", "fsdp"])
def test_an_online_run_over_two_ranks_keeps_each_ranks_share_and_verifies_in_one_process(runs, parallelism):
    out = runs[parallelism]
    b = open_bundle(out)
    assert b.manifest.online is not None and b.manifest.state_digest.endswith("/2")
    # one pass over ranks too: the chunks open into the state hash (version 4), no param_root
    assert b.manifest.tree and all(r.state_leaves and r.param_root is None for r in b.steps)
    # every state a selected step starts from is kept as both ranks' shares, never whole
    assert b.online_shards and not b.online_states
    assert all(set(shares) == {0, 1} for shares in b.online_shards.values())
    v = online(out, runs["beacon"])
    assert v.accepted and v.exact and v.replayed_steps >= 1, v.failures
    selected = {r.step for r in v.results if r.replayed_steps}
    assert selected == SELECTED and all(t in b.online_shards and t + 1 in b.online_shards for t in selected)
    v = Verifier(policy=Policy(challenges=100)).verify(out)  # and offline, every step replayed
    assert v.accepted and v.replayed_steps == 12


@pytest.mark.parametrize("parallelism", ["ddp", "fsdp"])
def test_the_every_step_check_catches_weights_swapped_on_one_ranks_rows(runs, parallelism):
    # each rank's rows of the parameters are a subtree of the chunk tree, which that rank hashed in its own
    # ring; the window's openings hold the chunks of every rank and the paths to the one param_root
    good = online(runs[parallelism], runs["beacon"])
    assert good.accepted and good.moves["checked"] == STEPS and good.moves["of"] == 2 * RANK1, good.moves
    assert good.moves["holding"] == 2 * RANK1 and "drawn among the 8 that hold parameters" in good.moves["summary"]
    # the swapped step is not selected, so no replay sees it; its move is out of every bound
    with pytest.raises(RunRejected, match=f"step {SWAP}: moves") as caught:
        online(runs[f"{parallelism}_swap"], runs["beacon"])
    # the coordinate named is the parameter's own: one of rank 1's rows (the second half of each tensor's rows)
    name, row = re.search(r"(model\.[\w.]+)\[(\d+)", str(caught.value)).groups()
    rows = dict(build_task("tiny", {"steps": STEPS, "batch_size": 16}).build_model(b"\0" * 32).named_parameters())
    assert int(row) >= -(-rows[name.removeprefix("model.")].shape[0] // 2), str(caught.value)
    assert ChunkLayout.of_model(build_task("tiny", {"steps": STEPS, "batch_size": 16}).build_model(b"\0" * 32), 1024,
                                2).shard_size == RANK1


def test_witness_beacon_puts_a_torchrun_script_online(runs):
    b = open_bundle(runs["env"])
    assert b.manifest.online is not None and b.manifest.online["every"] == 4 and b.statements is not None
    v = online(runs["env"], runs["beacon"])
    assert v.accepted and v.replayed_steps >= 1, v.failures


def test_each_rank_keeps_only_its_share(runs):
    b = open_bundle(runs["ddp"])
    n = min(b.online_shards)
    def size(tensors: dict) -> int:
        return sum(t.numel() * t.element_size() for t in tensors.values())

    shares = [size(load_file(b.online_shards[n][r])) for r in (0, 1)]
    joined = size(join_shares(b.online_shards[n], 2, n))
    assert sum(shares) < joined + 64 and all(s < 0.75 * joined for s in shares), (shares, joined)  # about half each
    costs = [json.loads(Path(f"{runs['dir'] / 'ddp.cost'}.{r}").read_text()) for r in (0, 1)]
    assert costs[0]["written"] == costs[1]["written"] == len(b.online_shards)
    # another rank never holds more than rank 0: rank 0 frees a state only once its note to the others is out
    assert costs[1]["peak_ring"] <= costs[0]["peak_ring"] <= 9, costs


@pytest.mark.parametrize("parallelism", ["ddp", "fsdp"])
def test_a_witnessed_run_over_two_ranks_is_accepted(runs, parallelism, capsys):
    out, loop = runs[f"{parallelism}_witnessed"], runs["loop"]
    assert open_bundle(out).online_shards
    code = main(["verify", "--allow-weak", str(out), "--mode", "online", *loop.witness_args(), "--drand",
                 str(loop.info), "--bad-fraction", "0.5", "--json"])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and report["accepted"], report


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _replayed_share(out: Path, beacon: str) -> int:
    """A kept state that the online audit loads from the ranks' shares: before a selected step."""
    b = open_bundle(out)
    steps = sorted(r.step for r in online(out, beacon).results if r.replayed_steps)
    assert steps == sorted(SELECTED) and all(t in b.online_shards and t not in b.checkpoints for t in steps)
    return steps[0]


def test_a_withheld_share_is_named(runs, tmp_path):
    out = _copy(runs["ddp"], tmp_path / "b")
    n = _replayed_share(out, runs["beacon"])
    (out / online_shard_name(n, 1)).unlink()
    with pytest.raises(RunRejected, match=f"no share of rank 1 of the state after {n}"):
        online(out, runs["beacon"])


def test_a_share_swapped_for_another_states_or_another_runs_is_rejected(runs, tmp_path):
    b = open_bundle(runs["ddp"])
    n = _replayed_share(runs["ddp"], runs["beacon"])
    m = next(k for k in sorted(b.online_shards) if k not in (0, n))  # a state with moments, as n has
    swapped = _copy(runs["ddp"], tmp_path / "swapped")  # rank 1's share of another state of the same run
    shutil.copy(swapped / online_shard_name(m, 1), swapped / online_shard_name(n, 1))
    # (its step counters, which every rank holds whole, may already give it away)
    with pytest.raises(RunRejected, match="does not hash to the committed state|ranks hold different values"):
        online(swapped, runs["beacon"])
    # rank 1's share of the same state of another run (another seed: other weights and data order)
    other = open_bundle(runs["ddp_witnessed"])
    mixed = _copy(runs["ddp"], tmp_path / "mixed")
    same = next((k for k in sorted(SELECTED) if k in other.online_shards), None)
    if same is None:  # the two runs' draws kept no state in common: rank 1's share of another of its states
        same = _replayed_share(runs["ddp"], runs["beacon"])
        shutil.copy(other.online_shards[min(other.online_shards)][1], mixed / online_shard_name(same, 1))
        with pytest.raises(RunRejected, match="does not hash to the committed state"):
            online(mixed, runs["beacon"])
        return
    shutil.copy(other.online_shards[same][1], mixed / online_shard_name(same, 1))
    with pytest.raises(RunRejected, match="does not hash to the committed state"):
        online(mixed, runs["beacon"])


def test_a_share_changed_or_split_otherwise_is_judged_by_the_joined_states_hash(runs, tmp_path):
    b = open_bundle(runs["fsdp"])
    n = _replayed_share(runs["fsdp"], runs["beacon"])
    path = b.online_shards[n][1]
    tensors, meta = load_file(path), json.loads(path.read_bytes()[8:8 + int.from_bytes(path.read_bytes()[:8], "little")])
    meta = meta["__metadata__"]
    # a weight nudged on one rank: the joined state is not the committed one
    nudged = _copy(runs["fsdp"], tmp_path / "nudged")
    name = next(k for k, t in tensors.items() if k.startswith("model.") and t.numel())
    changed = dict(tensors, **{name: tensors[name] + 1e-3})
    save_file(changed, nudged / online_shard_name(n, 1), meta)
    with pytest.raises(RunRejected, match="does not hash to the committed state"):
        online(nudged, runs["beacon"])
    # the ranks disagreeing on a counter every rank holds whole
    counter = next((k for k, t in tensors.items() if t.dim() == 0), None)
    if counter is not None:
        disagree = _copy(runs["fsdp"], tmp_path / "disagree")
        save_file(dict(tensors, **{counter: tensors[counter] + 1}), disagree / online_shard_name(n, 1), meta)
        with pytest.raises(RunRejected, match="different values"):
            online(disagree, runs["beacon"])
    # the same bytes with the rows split at another place: the joined state is the committed one
    moved = _copy(runs["fsdp"], tmp_path / "moved")
    zero = load_file(b.online_shards[n][0])
    rows = next(k for k, t in zero.items() if t.dim() and t.shape[0] > 1)
    save_file(dict(zero, **{rows: zero[rows][:-1]}), moved / online_shard_name(n, 0), meta)
    save_file(dict(tensors, **{rows: torch.cat([zero[rows][-1:], tensors[rows]])}), moved / online_shard_name(n, 1),
              meta)
    assert online(moved, runs["beacon"]).accepted


def test_shares_duplicated_beside_a_whole_state_or_of_a_rank_the_run_lacks_are_refused(runs, tmp_path):
    n = min(open_bundle(runs["ddp"]).online_shards)
    both = _copy(runs["ddp"], tmp_path / "both")
    shutil.copy(both / online_shard_name(n, 0), both / online_state_name(n))
    with pytest.raises(MalformedInput, match="both whole and as ranks' shares"):
        open_bundle(both)
    extra = _copy(runs["ddp"], tmp_path / "extra")
    shutil.copy(extra / online_shard_name(n, 1), extra / online_shard_name(n, 2))
    with pytest.raises(MalformedInput, match="rank 2 .* the run had 2 ranks"):
        open_bundle(extra)


def test_a_ring_whose_budget_cannot_hold_a_window_is_refused_on_every_rank_before_step_0(runs):
    out = runs["dir"] / "tight"
    res = launch(out, runs["key"], "fsdp", "--beacon", runs["url"], "--ring-bytes", "2000", env={"OMP_NUM_THREADS": "1"})
    assert res.returncode != 0
    assert "cannot hold one window" in res.stderr and "rank 0 could not start the run" in res.stderr
    assert not (out / LOG).exists()  # refused before anything was signed


def _with_shape(path: Path, name: str, shape: list[int]) -> None:
    """Rewrite a state file so that tensor ``name`` holds no bytes under ``shape`` (a header edit)."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header, body = json.loads(raw[8:8 + n]), raw[8 + n:]
    a, b = header[name]["data_offsets"]
    body = body[:a] + body[b:]
    for k, v in header.items():
        if k != "__metadata__" and v["data_offsets"][0] >= b:
            v["data_offsets"] = [v["data_offsets"][0] - (b - a), v["data_offsets"][1] - (b - a)]
    header[name].update(shape=shape, data_offsets=[a, a])
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + body)


@pytest.mark.parametrize("shape", [[0, 2**62], [0, 2**63 + 5]])
def test_a_share_with_an_empty_tensor_of_an_absurd_shape_is_malformed_not_a_crash(tmp_path, shape):
    meta = {"format": "witness-state/v1", "step": "3"}
    paths = {}
    for r in (0, 1):
        paths[r] = tmp_path / f"{r}.safetensors"
        save_file({"model.w": torch.ones(2, 2), "model.zz": torch.zeros(1, 1)}, paths[r], meta)
        _with_shape(paths[r], "model.zz", shape)
    with pytest.raises(MalformedInput, match="shape"):
        join_shares(paths, 2, 3)


def test_a_nan_every_rank_holds_is_the_same_value_not_a_disagreement(tmp_path):
    meta = {"format": "witness-state/v1", "step": "5"}
    whole = {"model.scale": torch.tensor(float("nan")), "model.w": torch.arange(6.0).reshape(3, 2)}
    paths = {}
    for r, (a, b) in enumerate([(0, 2), (2, 3)]):
        paths[r] = tmp_path / f"{r}.safetensors"
        save_file({"model.scale": whole["model.scale"].clone(), "model.w": whole["model.w"][a:b].clone()}, paths[r],
                  meta)
    joined = join_shares(paths, 2, 5)
    assert state_hash(joined, "blake3/2") == state_hash(whole, "blake3/2")
    save_file({"model.scale": torch.tensor(float("inf")), "model.w": whole["model.w"][2:].clone()}, paths[1], meta)
    with pytest.raises(VerificationError, match="different values of model.scale"):
        join_shares(paths, 2, 5)


def test_the_ring_is_sized_by_the_largest_ranks_share():
    from witness.record.start import kept_bytes

    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 1))  # [3, 4], [3], [1, 3], [1]
    opt = torch.optim.AdamW(model.parameters())
    whole = kept_bytes(model, opt)
    assert whole == 3 * 4 * (12 + 3 + 3 + 1)  # weights and biases, and two moments of each
    # rank 0 holds ceil(rows / 2) rows of every tensor: 2 of 3 (8 and 2 elements), 1 of 1 (3 and 1)
    assert kept_bytes(model, opt, 2) == 3 * 4 * (8 + 2 + 3 + 1)


@pytest.mark.parametrize("ranks", [2, 8, 64])
def test_a_window_opens_only_chunks_that_hold_parameters_however_many_ranks_the_run_claims(ranks):
    # each rank's chunks are padded with zero chunks to the same power of two; a draw that could land on
    # them would open nothing, and a trainer claiming many ranks would make most chunks padding (a whole
    # swapped model then passed a window whose k draws all fell on padding). Only chunks with bytes are drawn
    model = build_task("tinygpt", {"steps": 2, "n_layer": 2, "d_model": 16, "n_head": 2, "block": 16}).build_model(
        b"\0" * 32)
    layout = ChunkLayout.of_model(model, 1024, ranks)
    held = set(layout.holding)
    assert len(held) < layout.size  # (this layout has padding)
    for _ in range(300):
        chunks = layout.select(os.urandom(32), 2)
        assert len(set(chunks)) == 2 and set(chunks) <= held and chunks == sorted(chunks)
    # in one process every chunk holds bytes, and the draw is the one runs recorded before draw
    whole = ChunkLayout.of_model(model, 1024)
    beta = os.urandom(32)
    assert len(whole.holding) == whole.size and whole.select(beta, 2) == chunk_indices(beta, 2, whole.size)
