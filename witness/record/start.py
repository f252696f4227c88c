"""Where a run's records begin: a new run's manifest and initial state, or a killed run's bundle
reopened at an intact checkpoint. ``Recorder.create`` and ``Recorder.resume`` are these, with the
recorder and its self-check put on top."""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path
from typing import Any

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from .. import __version__, replays
from ..bundle.checkpoint import file_sha256, read_checkpoint, save_checkpoint
from ..bundle.layout import (
    CHECKPOINTS,
    HEADS,
    LEAVES,
    LOG,
    ONLINE,
    PROBES,
    checkpoint_name,
    partial_write,
)
from ..bundle.opened import TREE, check_tree_settings, hasher_for
from ..bundle.schema import (
    CHUNKED_MANIFEST_VERSION,
    MANIFEST_VERSION,
    TREE_MANIFEST_VERSION,
    Manifest,
    parse_online,
)
from ..bundle.state import default_digest, load_state, parse_digest, state_tensors
from ..bundle.writer import BundleWriter, read_lines, truncate_lines
from ..commit.blake3tree import CHUNK
from ..commit.hashing import canonical_json, parse_canonical_json
from ..commit.log import RunLog
from ..commit.signing import SignedTreeHead, public_hex
from ..data.dataset import DATA_COMMITMENT
from ..data.locate import asked, is_absolute, side_files
from ..data.order import derive_run_seed
from ..errors import MalformedInput
from ..fingerprint.chunks import ChunkLayout
from ..fingerprint.moves import move_rules
from ..session import (
    TrainingSession,
    bounded_threads,
    describe_device,
    deterministic_device,
    device_info,
    same_hardware,
    torch_version,
    warn_mkl,
)
from ..task.base import Task, model_device
from ..task.registry import build_task, check_task_source, task_class, task_source
from .link import BeaconLink, OnlineSpec, host_budget, ring_within
from .loop import adopt
from .online import OnlineChallenges
from .options import Commitments, Online, Training
from .records import Opened


def check_no_paths(recipe: Any, where: str = "recipe") -> None:  # noqa: ANN401 - a recipe's JSON
    """Refuse a recipe that names an absolute path: a verifier's data lies elsewhere, so a recipe
    names its data relative to a data folder (``witness.data.locate.data_file``)."""
    if isinstance(recipe, dict):
        for k, v in recipe.items():
            check_no_paths(v, f"{where}.{k}")
    elif isinstance(recipe, list):
        for i, v in enumerate(recipe):
            check_no_paths(v, f"{where}[{i}]")
    elif isinstance(recipe, str) and is_absolute(recipe):
        raise ValueError(f"{where} is the absolute path {recipe!r}: a verifier's copy of the data lies elsewhere. "
                         "Name the file relative to a data folder, read it with witness.data.locate.data_file(name), "
                         "and pass the folder with --data DIR (or WITNESS_DATA)")


def begin(task: Task, out: str | os.PathLike, key: Ed25519PrivateKey, r: bytes, commit: Commitments,
          training: Training, online: Online) -> tuple[Opened, dict, OnlineSpec | None]:
    """Start a new run in ``out``: derive the seed, build (or adopt) the initial state, write the
    initial checkpoint and the manifest, which the caller's first head signs. Returns the open
    bundle, the initial state and the online settings (None: no beacon)."""
    if len(r) != 32:
        raise ValueError("r must be 32 bytes")
    spec, beacon = online.spec, online.beacon
    if beacon is not None:
        chain = getattr(getattr(beacon, "chain", None), "hash", None)  # a witnessed link's drand chain
        spec = spec or OnlineSpec.for_steps(task.config.steps, drand=chain.hex() if chain else None)
        if chain and spec.drand is None:
            spec = dataclasses.replace(spec, drand=chain.hex())
        if commit.state_every != 1:
            raise ValueError("online challenges need the whole state committed at every step (state_every 1)")
        if training.shards > 1 and getattr(beacon, "publish", None) is not None:
            raise ValueError("a leaderboard replays an online run's kept states as it trains; a run over several "
                             "ranks keeps each state as its ranks' shares, which it does not take yet: stream "
                             "it without online challenges")
    if training.threads:
        torch.set_num_threads(bounded_threads(training.threads))
    warn_mkl()
    # Only a task a verifier can build is worth recording: built in, or from an installed
    # plugin (whose code the manifest pins); an unregistered class would be unverifiable.
    if task_class(task.name) is not type(task):
        raise ValueError(f"the task {task.name!r} being recorded is not the registered class of that name")
    source = task_source(task.name)
    check_no_paths(task.config_json())
    with asked() as read:  # the data files the task reads: the small ones are pinned by content
        dataset = task.dataset()
        task.probe_bytes()
    # a task built before in this process (build_task's cache) read its files then: it noted them
    read += [n for n in getattr(task, "data_names", list)() if n not in read]
    if dataset.DOCUMENT_RULE != task.document_rule:
        raise ValueError(f"the task {task.name!r} decides document rule {task.document_rule!r}, but its "
                         f"dataset gives documents under {dataset.DOCUMENT_RULE!r}: a verifier would reject "
                         "every data claim of the run")
    # the commitment this release writes (a test may ask for an older release's, to check that
    # runs recorded by it still verify)
    version = DATA_COMMITMENT
    data_root = dataset.commitment_root(version)
    run_seed = derive_run_seed(data_root, r)
    multi = torch.distributed.is_available() and torch.distributed.is_initialized() \
        and torch.distributed.get_world_size() > 1
    model, device, session = training.model, training.device, training.session
    if multi and session is None:  # every rank would write the one bundle as a run of its own
        raise ValueError("a torchrun process is recorded with start_run (a loop of its own, wrapped in DDP) or "
                         "witness.distributed.DistRecorder (docs/distributed.md), not Recorder.create")
    if model is not None and str(device) == "cpu":
        device = model_device(model)  # where the loop put its model
    if session is None:
        with asked() as built:
            session = TrainingSession(task, run_seed, len(dataset), device=device)
        read += [n for n in built if n not in read]
    elif session.run_seed != run_seed:
        raise ValueError("the session was built from another run seed")
    if model is not None:
        adopt(session, model, training.optimizer)
    if spec is not None:  # before anything is written: a ring that cannot hold a window is refused here
        budget = host_budget() if online.ring_bytes is None else online.ring_bytes
        # over several ranks each keeps its share of the rows: about 1/ranks of a state
        spec = ring_within(spec, kept_bytes(session.model, session.optimizer, training.shards), budget)
    if spec is not None and spec.chunks:
        rules = move_rules(getattr(session, "module", session.model), session.optimizer)
        if isinstance(rules, str):  # no bound to check a step's move against: the chunks would prove nothing
            print(f"witness: the bounded-move check is off for this run: {rules}", file=sys.stderr)
            spec = dataclasses.replace(spec, chunks=0)
    if spec is not None and spec.tree and not (spec.chunks and spec.chunk_bytes == CHUNK
                                               and parse_digest(default_digest(training.shards))[0] == TREE):
        # one pass commits everything where it can: the chunks open into the state hash's own trees (version
        # 4); in chunks of another size, or without BLAKE3, they open into a param_root (version 3)
        spec = dataclasses.replace(spec, tree=None)
    if spec is not None and spec.tree:  # on a GPU by the Triton kernels (each rank its share); else on the host
        spec = dataclasses.replace(spec, hashed_by=hasher_for(session.device))
        try:  # a window's openings a verifier would refuse to read are refused before step 0
            check_tree_settings(spec.to_json(), default_digest(training.shards))
        except MalformedInput as e:
            raise ValueError(str(e)) from None
    if spec is not None:
        try:  # the settings the manifest will hold, as every verifier parses them (their bounds with them)
            parse_online(spec.to_json(), "online")
        except MalformedInput as e:
            raise ValueError(f"these online settings would make a manifest no verifier reads: {e}") from None
    writer = BundleWriter(Path(out), create=True)
    if commit.leaves and version >= 2:  # the per-sample commitments, which the cheap audit checks every step against
        dataset.leaves.write(Path(out) / LEAVES, data_root)
    # the probes travel with the bundle (their hash is the manifest's probe_hash): a verifier
    # without the training data still has them, and checks them against the committed leaves
    (Path(out) / PROBES).write_bytes(canonical_json([p.hex() for p in task.probe_bytes()]))
    init_state = training.init_state
    if init_state is None:
        init_state = state_tensors(session.model, session.optimizer)
    digest = default_digest(training.shards)
    init_hash, init_file = save_checkpoint(Path(out) / checkpoint_name(0), init_state, 0, digest)
    manifest = {
        "type": "manifest",
        "format_version": (TREE_MANIFEST_VERSION if spec.tree else CHUNKED_MANIFEST_VERSION)
        if spec is not None and spec.chunks else MANIFEST_VERSION,
        "task": task.name,
        "task_config": task.config_json(),
        "code_version": __version__,
        "r": r.hex(),
        "r_source": commit.r_source,
        "run_seed": run_seed.hex(),
        "data_root": data_root.hex(),
        "dataset_size": len(dataset),
        "probe_hash": task.probe_hash().hex(),
        "fingerprint_spec": task.fingerprint_spec(),
        "checkpoint_every": commit.checkpoint_every,
        "state_every": commit.state_every,
        "state_digest": digest,
        "steps_planned": task.config.steps,
        "world_size": session.world_size,
        "parallelism": training.parallelism,
        "threads": torch.get_num_threads(),
        "versions": {"torch": torch_version(), "device": device_info(session.device, task.compiles)},
        "public_key": public_hex(key.public_key()),
        "init_state_hash": init_hash.hex(),
        "init_checkpoint_sha256": init_file.hex(),
    }
    if version >= 2:
        manifest["data_commitment"] = version
    if source is not None:  # a plugin task: pin the exact installed code a verifier must have
        manifest["task_source"] = source.to_json()
    if spec is not None:
        manifest["online"] = spec.to_json()
    pins = side_files(read)
    if pins:  # so that a verifier finds each wherever it lies, by its content
        manifest["data_files"] = pins
    log = RunLog()
    writer.append_record(log.append(manifest))
    return Opened(task, Path(out), session, writer, log, manifest, 0), init_state, spec


def kept_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer, shards: int = 1) -> int:
    """The bytes of one state the ring keeps: every tensor of the state, with the optimizer's moments
    counted before the first step creates them (two a parameter for Adam's kind, three with amsgrad,
    one for SGD with momentum, none for plain SGD; two for an optimizer not known here). Over
    ``shards`` ranks, the largest rank's share: rank 0's ceil(rows / shards) rows of every tensor,
    and every 0-dimensional tensor whole."""
    def share(t: torch.Tensor) -> int:
        size = t.numel() * t.element_size()
        if shards == 1 or t.dim() == 0 or not t.shape[0]:
            return size
        return -(-t.shape[0] // shards) * (size // t.shape[0])

    size = sum(share(t) for t in state_tensors(model, optimizer).values())
    if not optimizer.state:
        d = optimizer.defaults
        moments = 3 if d.get("amsgrad") else 1 if "momentum" in d and "betas" not in d else 2
        if "momentum" in d and "betas" not in d and not d["momentum"]:
            moments = 0
        size += moments * sum(share(p) for g in optimizer.param_groups for p in g["params"] if p.requires_grad)
    return size


def challenges(out: Path, session: Any, manifest: dict, spec: OnlineSpec, beacon: BeaconLink,  # noqa: ANN401
               key: Ed25519PrivateKey, log: RunLog) -> OnlineChallenges:
    """The ring and statements of a run that takes online challenges from ``beacon`` (its
    checkpoints, for a witnessed link, are notes the run's key signs)."""
    if hasattr(beacon, "use_key"):
        beacon.use_key(key)  # type: ignore[attr-defined]
    # named as in the state: a distributed session's unwrapped module, not its DDP wrapper
    module = getattr(session, "module", session.model)
    layout = None
    if spec.chunks:  # over W ranks, rank 0's own rows (witness.distributed keeps the other ranks')
        shards = parse_digest(manifest["state_digest"])[1]
        layout = ChunkLayout.of_model(module, spec.chunk_bytes, shards)
        layout = layout.shard(0) if shards > 1 else layout
    return OnlineChallenges(out, spec, beacon, log, manifest["steps_planned"], session.task.dataset(),
                            manifest["checkpoint_every"], layout)


def reopen(out: str | os.PathLike, key: Ed25519PrivateKey, threads: int | None, beacon: BeaconLink | None,
           session: TrainingSession | None = None) -> tuple[Opened, OnlineChallenges | None, dict[int, SignedTreeHead]]:
    """Reopen a killed run at the intact checkpoint it continues from, with every signed head kept
    valid. Returns the open bundle (its state loaded), its online challenges (None: none), and its
    signed heads by size.

    Records that a head signed already are trained again from the checkpoint before them and
    must come out bit for bit the same. An online run resumes from the checkpoint before the
    first state it may still be asked for (a selected state the crash lost, or the first step no
    statement covers), with every statement the beacon gave kept or fetched again.

    ``session``: a torchrun run's (``witness.distributed``), built by every rank from the manifest;
    its ranks then load the checkpoint ``Opened.start_step`` names themselves.
    """
    out = Path(out)
    lines = read_lines(out / LOG)
    if not lines:
        raise ValueError(f"{out} holds no run to resume")
    manifest = parse_canonical_json(lines[0])
    if manifest["public_key"] != public_hex(key.public_key()):
        raise ValueError("the run was signed with another key")
    if session is None and manifest["world_size"] != 1:
        raise ValueError("a torchrun run is resumed under torchrun, on as many ranks as it started on, with "
                         "witness.distributed.DistRecorder.resume")
    if session is not None and manifest.get("online") is not None:
        raise ValueError("resuming a torchrun run that takes online challenges is not built yet: its ranks' rings "
                         "would have to be filled again (docs/distributed.md)")
    started = Manifest.parse(manifest)
    # the rest of the run must be trained by the same code as its start (a plugin may have changed)
    if not replays(started.code_version):
        raise ValueError(f"the run was started by witness {started.code_version}, whose steps this "
                         f"release ({__version__}) does not reproduce: resume it with that release")
    check_task_source(manifest["task"], manifest.get("task_source"))
    # the rest of the run trains where its start did (a GPU run resumes on the GPU), with the same
    # kernels: a run whose steps came from two kinds of hardware would replay on neither
    if started.torch_version != torch_version():
        raise ValueError(f"the run was started with torch {started.torch_version}; this is torch "
                         f"{torch_version()}: resume it with the torch release that started it")
    kind = started.device["kind"]
    here = device_info(deterministic_device(kind), "compiler" in started.device)
    if not same_hardware(started.device, here):
        raise ValueError(f"the run was started on {describe_device(started.device)}; this is "
                         f"{describe_device(here)}: resume it on the same hardware")
    task = build_task(manifest["task"], manifest["task_config"])
    # the run's own thread count: a thread-dependent kernel would otherwise change its bits
    torch.set_num_threads(bounded_threads(threads or manifest["threads"]))
    records = [parse_canonical_json(line) for line in lines[1:]]
    ended = bool(records) and records[-1]["type"] == "end"
    # an online run whose audit did not settle is finished by a resume: killed while its last windows
    # waited for their rounds (its journal of cosigned checkpoints stays until every window is kept),
    # or stopped by a beacon or witness outage longer than its patience as its last heads went out
    if ended and started.online is None:
        raise ValueError(f"the run in {out} is already complete")
    intact = [0]
    steps = 0
    for i, rec in enumerate(records):
        if rec.get("type") != "step" or rec.get("step") != i:
            break
        steps = i + 1
        if "checkpoint_sha256" in rec:
            path = out / checkpoint_name(i + 1)
            if path.exists() and file_sha256(path).hex() == rec["checkpoint_sha256"]:
                intact.append(i + 1)
    heads = [SignedTreeHead.from_json(parse_canonical_json(line)) for line in read_lines(out / HEADS)]
    signed = max((h.size for h in heads), default=1)  # records a head signed stay, whatever happens
    if signed > steps + 1 + ended:
        raise ValueError("a signed head covers records that are not in the log; cannot resume")
    distributed = session is not None
    if session is None:
        session = TrainingSession(task, bytes.fromhex(manifest["run_seed"]), manifest["dataset_size"], device=kind)
    online = None
    if started.online is None and beacon is not None:
        raise ValueError("the run was started without online challenges; it cannot take them from the middle")
    if started.online is not None:
        if beacon is None:
            raise ValueError("the run takes online challenges: resume it with its beacon")
        spec = OnlineSpec(**{"chunks": 0, "tree": None} | started.online)  # (a run without chunks names none)
        online = challenges(out, session, manifest, spec, beacon, key, RunLog(lines[:signed]))
        online.load()
        if ended and online.settled(len(lines)):
            raise ValueError(f"the run in {out} is already complete: every head it signed is answered and every "
                             "state its statements select is written")
    last = max(signed - 1, intact[-1])  # steps kept in the log
    limit = min(last, online.first_needed()) if online is not None else last
    resume_at = max(c for c in intact if c <= limit)
    keep = last + 1
    truncate_lines(out / LOG, keep)
    truncate_lines(out / HEADS, len(heads))
    for f in (out / CHECKPOINTS).iterdir():
        if partial_write(f"{CHECKPOINTS}/{f.name}") or int(f.name.split(".")[0]) > last:
            f.unlink()
    for f in (out / ONLINE).glob("*/*"):  # a selected state or samples file the crash cut short
        if partial_write(f.relative_to(out).as_posix()):
            f.unlink()
    if not distributed:  # (every rank of a torchrun run loads its own share)
        load_state(session.model, session.optimizer, read_checkpoint(out / checkpoint_name(resume_at)))
    log = RunLog(lines[:keep])
    opened = Opened(session.task, out, session, BundleWriter(out, create=False), log, manifest, resume_at)
    if online is not None:
        online.log = log
        online.keep(resume_at, state_tensors(session.model, session.optimizer))
    return opened, online, {h.size: h for h in heads}
