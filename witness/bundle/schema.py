"""Strict schemas of the log records: the manifest, one record per step, and the end record."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..commit.hashing import parse_hex
from ..errors import MalformedInput
from ..fingerprint.chunks import MAX_CHUNK_BYTES, MIN_CHUNK_BYTES
from .opened import check_tree_settings
from .state import parse_digest

MANIFEST_VERSION = 2
# version 3: an online run that commits its parameters' chunks (online.chunks, online.chunk_bytes) and
# a param_root in every step record; a run without them is written as version 2, which every
# verifier since witness 0.2 reads
CHUNKED_MANIFEST_VERSION = 3
# version 4 (witness 0.8): the chunks open into the state hash itself (online.tree "blake3": each chunk a
# chunk of its tensor's BLAKE3 tree, witness.bundle.opened); every step record commits its state's hash
# and the leaves of its state tree (state_leaves), and no param_root. Versions 2 and 3 still verify
TREE_MANIFEST_VERSION = 4
MANIFEST_VERSIONS = (MANIFEST_VERSION, CHUNKED_MANIFEST_VERSION, TREE_MANIFEST_VERSION)
MAX_STATE_LEAVES = 1 << 24  # tensors in a state (a 2B-parameter model has a few thousand)
NONFINITE = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}


def _fail(where: str, msg: str) -> MalformedInput:
    return MalformedInput(f"{where}: {msg}")


def _keys(obj: Any, required: set[str], optional: set[str], where: str) -> dict:
    if not isinstance(obj, dict):
        raise _fail(where, "must be a JSON object")
    missing = required - set(obj)
    extra = set(obj) - required - optional
    if missing:
        raise _fail(where, f"missing fields {sorted(missing)}")
    if extra:
        raise _fail(where, f"unexpected fields {sorted(extra)}")
    return obj


def _int(v: Any, where: str, lo: int = 0, hi: int = 1 << 62) -> int:
    if type(v) is not int or not lo <= v <= hi:
        raise _fail(where, f"must be an integer in [{lo}, {hi}]")
    return v


def _float(v: Any, where: str) -> float:
    if type(v) is float or type(v) is int:
        return float(v)
    if isinstance(v, str) and v in NONFINITE:
        return NONFINITE[v]
    raise _fail(where, "must be a number")


def _floats(v: Any, where: str, max_len: int = 4096) -> tuple[float, ...]:
    if not isinstance(v, list) or len(v) > max_len:
        raise _fail(where, f"must be a list of at most {max_len} numbers")
    return tuple(_float(x, where) for x in v)


def _str(v: Any, where: str, max_len: int = 256) -> str:
    if not isinstance(v, str) or len(v) > max_len:
        raise _fail(where, f"must be a string of at most {max_len} characters")
    return v


def _dict(v: Any, where: str) -> dict:
    if not isinstance(v, dict):
        raise _fail(where, "must be an object")
    return v


@dataclass(frozen=True)
class Manifest:
    """The recipe and every seed, signed before step 0 (the log's first record)."""

    raw: dict
    task: str
    task_config: dict
    r: bytes
    r_source: str
    run_seed: bytes
    data_root: bytes
    dataset_size: int
    probe_hash: bytes
    checkpoint_every: int
    state_every: int
    state_digest: str
    steps_planned: int
    world_size: int
    parallelism: str
    threads: int
    code_version: str
    torch_version: str
    public_key: str
    init_state_hash: bytes
    init_checkpoint_sha256: bytes
    task_source: dict | None  # the plugin that provides the task (None: built into witness)
    device: dict  # where the run's kernels ran: {"kind": "cpu", "machine"} or the GPU and its libraries
    # which dataset commitment data_root is: 2 binds each sample's documents into its leaf; 1 (runs
    # recorded before witness 0.5, which do not name it) the sample alone
    data_commitment: int = 1
    # online challenges (a beacon's statements select steps while the run trains): p, every, ring, and
    # (version 3) the chunks each window opens of every state, and their size
    online: dict | None = None

    @property
    def chunked(self) -> bool:
        """Whether every step record commits its parameters' chunks (a ``param_root``)."""
        return self.online is not None and "chunks" in self.online

    @property
    def tree(self) -> bool:
        """Whether the chunks open into the state hash's own BLAKE3 trees (version 4), not a param_root."""
        return self.online is not None and "tree" in self.online

    @property
    def state_shards(self) -> int:
        """The ranks whose rows the state digest (and a chunked run's chunk layout) splits the state over."""
        return parse_digest(self.state_digest)[1]

    FIELDS = {
        "type", "format_version", "task", "task_config", "code_version", "r", "r_source", "run_seed",
        "data_root", "dataset_size", "probe_hash", "fingerprint_spec", "checkpoint_every", "state_every",
        "state_digest", "steps_planned", "world_size", "parallelism", "threads", "versions",
        "public_key", "init_state_hash", "init_checkpoint_sha256",
    }

    @classmethod
    def parse(cls, obj: Any) -> Manifest:
        """Strictly parse the manifest record."""
        w = "manifest"
        _keys(obj, cls.FIELDS, {"task_source", "data_commitment", "online", "data_files"}, w)
        if "data_files" in obj:
            parse_data_files(obj["data_files"], f"{w}.data_files")
        online = parse_online(obj["online"], f"{w}.online") if "online" in obj else None
        if "data_commitment" in obj and (type(obj["data_commitment"]) is not int or obj["data_commitment"] != 2):
            raise _fail(w, "data_commitment must be 2 (or absent: version 1)")
        source = obj.get("task_source")
        if source is not None:
            _keys(source, {"distribution", "version", "files_sha256"}, set(), f"{w}.task_source")
            for k in ("distribution", "version"):
                _str(source[k], f"{w}.task_source.{k}", 200)
            parse_hex(source["files_sha256"], f"{w}.task_source.files_sha256")
        if obj["type"] != "manifest":
            raise _fail(w, "the log's first record must be the manifest")
        if type(obj["format_version"]) is not int or obj["format_version"] not in MANIFEST_VERSIONS:
            raise _fail(w, f"unsupported manifest version {obj['format_version']!r}")
        chunked = online is not None and "chunks" in online
        tree = online is not None and "tree" in online
        if (chunked and not tree) != (obj["format_version"] == CHUNKED_MANIFEST_VERSION):
            raise _fail(w, f"a manifest of version {CHUNKED_MANIFEST_VERSION} is an online run's that commits its "
                           "parameters' chunks (online.chunks) in a param_root, and only such a run's")
        if tree != (obj["format_version"] == TREE_MANIFEST_VERSION):
            raise _fail(w, f"a manifest of version {TREE_MANIFEST_VERSION} is an online run's whose chunks open into "
                           "its state hash (online.tree), and only such a run's")
        if tree:
            check_tree_settings(online, obj["state_digest"])  # type: ignore[arg-type]
        _dict(obj["fingerprint_spec"], f"{w}.fingerprint_spec")
        versions = _keys(obj["versions"], {"torch"}, {"device"}, f"{w}.versions")
        device = versions.get("device", {"kind": "cpu"})  # recorded before devices were: the CPU
        # nccl, pins: a GPU run's NCCL release and its collective and tuning pins (witness.session, version 4)
        _keys(device, {"kind"}, {"machine", "kernels", "name", "cuda", "cudnn", "driver", "compiler", "nccl", "pins"},
              f"{w}.versions.device")
        for k, v in device.items():
            _str(v, f"{w}.versions.device.{k}", 128)
        if device["kind"] not in ("cpu", "cuda"):
            raise _fail(w, "versions.device.kind must be cpu or cuda")
        if obj["r_source"] not in ("trainer", "ticket"):
            raise _fail(w, "r_source must be trainer or ticket")
        if obj["parallelism"] not in ("none", "ddp", "fsdp"):
            raise _fail(w, "parallelism must be none, ddp or fsdp")
        try:
            _, shards = parse_digest(obj["state_digest"])
        except MalformedInput as e:
            raise _fail(w, f"state_digest: {e}") from None
        if shards > 1 and (obj["parallelism"] not in ("ddp", "fsdp") or shards != obj["world_size"]):
            raise _fail(w, "state_digest: row shards are a distributed run's, one shard per rank")
        state_every = _int(obj["state_every"], f"{w}.state_every", 1)
        checkpoint_every = _int(obj["checkpoint_every"], f"{w}.checkpoint_every", 1)
        if checkpoint_every % state_every:
            raise _fail(w, "checkpoint_every must be a multiple of state_every (every checkpoint is a committed state)")
        if online is not None and state_every != 1:
            raise _fail(w, "online challenges need the whole state committed at every step (state_every 1)")
        return cls(
            raw=obj,
            task=_str(obj["task"], f"{w}.task", 64),
            task_config=_dict(obj["task_config"], f"{w}.task_config"),
            r=parse_hex(obj["r"], f"{w}.r"),
            r_source=obj["r_source"],
            run_seed=parse_hex(obj["run_seed"], f"{w}.run_seed"),
            data_root=parse_hex(obj["data_root"], f"{w}.data_root"),
            dataset_size=_int(obj["dataset_size"], f"{w}.dataset_size", 1),
            probe_hash=parse_hex(obj["probe_hash"], f"{w}.probe_hash"),
            checkpoint_every=checkpoint_every,
            state_every=state_every,
            state_digest=obj["state_digest"],
            steps_planned=_int(obj["steps_planned"], f"{w}.steps_planned", 1),
            world_size=_int(obj["world_size"], f"{w}.world_size", 1, 1 << 20),
            parallelism=obj["parallelism"],
            threads=_int(obj["threads"], f"{w}.threads", 1, 4096),
            code_version=_str(obj["code_version"], f"{w}.code_version", 64),
            torch_version=_str(versions["torch"], f"{w}.versions.torch", 64),
            public_key=_str(obj["public_key"], f"{w}.public_key", 64),
            init_state_hash=parse_hex(obj["init_state_hash"], f"{w}.init_state_hash"),
            init_checkpoint_sha256=parse_hex(obj["init_checkpoint_sha256"], f"{w}.init_checkpoint_sha256"),
            task_source=source,
            device=dict(device),
            data_commitment=obj.get("data_commitment", 1),
            online=online,
        )


MAX_ONLINE_RING = 1 << 16
MAX_OPENED_CHUNKS = 256  # chunks a window opens of each state
MAX_WINDOW_OPENED = 256 << 20  # chunk bytes a window's openings may hold (every + 1 states)


def parse_data_files(obj: Any, where: str) -> dict:
    """The small data files a run's task read, by name: their SHA-256 and size (found by content)."""
    from ..data.locate import SIDE_FILE_MAX, SIDE_FILES_MAX, check_name

    _dict(obj, where)
    if len(obj) > SIDE_FILES_MAX:
        raise _fail(where, f"more than {SIDE_FILES_MAX} files")
    for name, v in obj.items():
        try:
            check_name(name)
        except ValueError as e:
            raise _fail(where, str(e)) from None
        if len(name) > 512:
            raise _fail(where, "a data name over 512 characters")
        _keys(v, {"sha256", "size"}, {"folder"}, f"{where}[{name!r}]")
        if "folder" in v and v["folder"] is not True:  # a folder (a tokenizer's) is pinned by its files
            raise _fail(f"{where}[{name!r}].folder", "must be true where present")
        parse_hex(v["sha256"], f"{where}[{name!r}].sha256")
        _int(v["size"], f"{where}[{name!r}].size", 0, SIDE_FILE_MAX)
    return obj


def parse_online(obj: Any, where: str) -> dict:
    """The online-challenge settings: selection probability p in (0, 1], a head every ``every``
    steps, and a ring of ``ring`` > ``every`` host states."""
    # drand: the chain hash of the drand chain a witnessed run's rounds come from (informative: the
    # verifier pins its own chain); chunks and chunk_bytes: the parameter chunks each window opens of
    # every state (both or neither)
    # tree: "blake3", the chunks open into the state hash's own trees (version 4); hashed_by: where the
    # trainer hashed its states ("host" or "cuda": the same digests, informative)
    _keys(obj, {"p", "every", "ring"}, {"drand", "chunks", "chunk_bytes", "tree", "hashed_by"}, where)
    p = obj["p"]
    if type(p) is not float or not 0.0 < p <= 1.0:
        raise _fail(where, "p must be a number in (0, 1]")
    every = _int(obj["every"], f"{where}.every", 1, MAX_ONLINE_RING)
    ring = _int(obj["ring"], f"{where}.ring", 2, MAX_ONLINE_RING)
    if ring <= every:
        raise _fail(where, "the ring must hold more states than a head covers steps (ring > every)")
    out = {"p": p, "every": every, "ring": ring}
    if "drand" in obj:
        out["drand"] = parse_hex(obj["drand"], f"{where}.drand").hex()
    if ("chunks" in obj) != ("chunk_bytes" in obj):
        raise _fail(where, "chunks and chunk_bytes come together")
    if "chunks" in obj:
        out["chunks"] = _int(obj["chunks"], f"{where}.chunks", 1, MAX_OPENED_CHUNKS)
        size = _int(obj["chunk_bytes"], f"{where}.chunk_bytes", MIN_CHUNK_BYTES, MAX_CHUNK_BYTES)
        if size & (size - 1):
            raise _fail(where, "chunk_bytes must be a power of two")
        if (every + 1) * out["chunks"] * size > MAX_WINDOW_OPENED:  # what a verifier holds of one window
            raise _fail(where, f"a window's openings (every + 1 states of chunks x chunk_bytes) may hold at most "
                               f"{MAX_WINDOW_OPENED >> 20} MiB")
        out["chunk_bytes"] = size
    if ("tree" in obj or "hashed_by" in obj) and ("chunks" not in obj or "tree" not in obj or "hashed_by" not in obj):
        raise _fail(where, "tree and hashed_by come together, with chunks")
    if "tree" in obj:
        out["tree"] = _str(obj["tree"], f"{where}.tree", 16)
        if obj["hashed_by"] not in ("host", "cuda"):
            raise _fail(where, "hashed_by must be host or cuda")
        out["hashed_by"] = obj["hashed_by"]
    return out


@dataclass(frozen=True)
class StepRecord:
    """One optimizer step: its batch, loss, lr, gradient norm, and the fingerprint after it."""

    raw: dict
    step: int
    batch: tuple[int, ...]
    batch_root: bytes
    loss: float
    lr: float
    grad_norm: float
    probe_loss: tuple[float, ...]
    projection: tuple[float, ...]
    digest: bytes
    sketch: tuple[float, ...]
    state_hash: bytes | None
    checkpoint_sha256: bytes | None
    round: int | None = None  # the drand round of the witnessed window this record closes
    param_root: bytes | None = None  # the chunk tree root of the parameters after the step (version 3)
    state_leaves: int | None = None  # the leaves of the state tree state_hash is the root of (version 4)

    @property
    def fingerprint_vector(self) -> list[float]:
        """Numeric part of the fingerprint."""
        return [*self.probe_loss, *self.projection]

    @classmethod
    def parse(cls, obj: Any, where: str) -> StepRecord:
        """Strictly parse a step record."""
        req = {"type", "step", "batch", "batch_root", "loss", "lr", "grad_norm", "fingerprint", "sketch"}
        # round: the drand round a witnessed window's closing record names (online challenges with witnesses)
        # param_root: the root of the parameters' chunk tree after the step (an online run's, version 3)
        # state_leaves: how many leaves the tree of state_hash has (a version 4 run's: it fixes where an opened
        # tensor's leaf lies, before the window's draw)
        _keys(obj, req, {"state_hash", "checkpoint_sha256", "round", "param_root", "state_leaves"}, where)
        if obj["type"] != "step":
            raise _fail(where, f"expected a step record, found {obj['type']!r}")
        if "checkpoint_sha256" in obj and "state_hash" not in obj:
            raise _fail(where, "a checkpoint record also commits its state_hash")
        batch = obj["batch"]
        if not isinstance(batch, list) or not 1 <= len(batch) <= 1 << 20:
            raise _fail(where, "batch must be a non-empty list of sample indices")
        fp = _keys(obj["fingerprint"], {"probe_loss", "projection", "digest"}, set(), f"{where}.fingerprint")
        return cls(
            raw=obj,
            step=_int(obj["step"], f"{where}.step"),
            batch=tuple(_int(i, f"{where}.batch") for i in batch),
            batch_root=parse_hex(obj["batch_root"], f"{where}.batch_root"),
            loss=_float(obj["loss"], f"{where}.loss"),
            lr=_float(obj["lr"], f"{where}.lr"),
            grad_norm=_float(obj["grad_norm"], f"{where}.grad_norm"),
            probe_loss=_floats(fp["probe_loss"], f"{where}.fingerprint.probe_loss"),
            projection=_floats(fp["projection"], f"{where}.fingerprint.projection"),
            digest=parse_hex(fp["digest"], f"{where}.fingerprint.digest"),
            sketch=_floats(obj["sketch"], f"{where}.sketch", 1024),
            state_hash=parse_hex(obj["state_hash"], f"{where}.state_hash") if "state_hash" in obj else None,
            checkpoint_sha256=parse_hex(obj["checkpoint_sha256"], f"{where}.checkpoint_sha256")
            if "checkpoint_sha256" in obj
            else None,
            round=_int(obj["round"], f"{where}.round", 1) if "round" in obj else None,
            param_root=parse_hex(obj["param_root"], f"{where}.param_root") if "param_root" in obj else None,
            state_leaves=_int(obj["state_leaves"], f"{where}.state_leaves", 1, MAX_STATE_LEAVES)
            if "state_leaves" in obj else None,
        )


# The end record's fields that the final tree head also signs as extensions, so certificates
# and data proofs can bind to the head alone.
HEAD_EXTENSION_FIELDS = ("document_rule", "used_documents", "used_samples", "final_state_hash", "final_model_hash",
                         "task")
# ...of which runs before witness 0.5 lacked the task (a data proof's checker takes the document
# rule from the task the head names)
LATER_END_FIELDS = ("task",)


@dataclass(frozen=True)
class TreeCommitment:
    """Root and size of a sorted tree."""

    root: bytes
    size: int


@dataclass(frozen=True)
class EndRecord:
    """The run's last record: how many steps, the final state, and what data the run used."""

    raw: dict
    steps: int
    final_state_hash: bytes
    final_model_hash: bytes
    document_rule: str
    used_documents: TreeCommitment
    used_samples: TreeCommitment
    task: str | None = None
    round: int | None = None  # the drand round of the final witnessed window

    @classmethod
    def parse(cls, obj: Any, where: str) -> EndRecord:
        """Strictly parse the end record."""
        _keys(obj, {"type", "steps", *HEAD_EXTENSION_FIELDS} - set(LATER_END_FIELDS), {*LATER_END_FIELDS, "round"},
              where)
        if obj["type"] != "end":
            raise _fail(where, "expected the end record")
        if obj["document_rule"] not in ("self", "prefix32"):
            raise _fail(where, "unknown document rule")

        def tree(key: str) -> TreeCommitment:
            t = _keys(obj[key], {"root", "size"}, set(), f"{where}.{key}")
            return TreeCommitment(parse_hex(t["root"], f"{where}.{key}.root"), _int(t["size"], f"{where}.{key}.size"))

        return cls(obj, _int(obj["steps"], f"{where}.steps", 1),
                   parse_hex(obj["final_state_hash"], f"{where}.final_state_hash"),
                   parse_hex(obj["final_model_hash"], f"{where}.final_model_hash"),
                   obj["document_rule"], tree("used_documents"), tree("used_samples"),
                   _str(obj["task"], f"{where}.task", 64) if "task" in obj else None,
                   _int(obj["round"], f"{where}.round", 1) if "round" in obj else None)
