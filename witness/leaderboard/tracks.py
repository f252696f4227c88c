"""Tracks: the registered recipes a leaderboard certifies (it never runs submitted code)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from ..commit.beacon import p_needed
from ..commit.drand import ChainInfo
from ..commit.hashing import canonical_json
from ..commit.note import NoteKey
from ..methods.contest import CAPS, Budget
from ..task.registry import build_task


@dataclass(frozen=True)
class TrackSpec:
    """A track: a registered task with a fixed recipe, and the metric its table ranks by."""

    name: str
    task: str
    config: dict = field(default_factory=dict)
    metric: str = "mean_loss"
    higher_is_better: bool = False
    description: str = ""
    # Online challenges required, with at least this selection probability (None: not required;
    # a run that takes them from this server's beacon is audited online either way).
    online_p: float | None = None
    # The largest upload of a run of this track, in bytes (a submission, or one online state);
    # None: the server's --max-upload. A track of large models declares its own.
    max_upload: int | None = None
    # Witnessed: online challenges drawn by drand and cosigned by these witnesses (their names, among the
    # server's configured ones), at least ``quorum`` of them (default: all) for each window.
    witnesses: tuple[str, ...] = ()
    quorum: int | None = None
    # certified seeds a method needs to enter the ranking of methods (``ranking``)
    min_seeds: int = 3
    # a contest track: the task fixes only the data, the evaluation split and the scoring; runs bring their
    # own method (a wheel, admitted against this budget)
    budget: Budget | None = None

    def resolve(self, witnessing: Witnessing | None = None) -> dict:
        """The row the database stores: exact recipe, dataset root, evaluation split, and a witnessed
        track's trust (its witnesses' keys from the server's ``witnessing``)."""
        task = build_task(self.task, self.config)
        ev = task.eval_dataset()
        return {
            "name": self.name,
            "task": self.task,
            "config_json": canonical_json(task.config_json()).decode(),
            "data_root": task.dataset().root.hex(),
            "eval_root": ev.root.hex(),
            "eval_size": len(ev),
            "metric": self.metric,
            "higher_is_better": self.higher_is_better,
            "description": self.description,
            "online_p": self.online_p,
            "witnessed_json": self._witnessed(witnessing),
            "min_seeds": self.min_seeds,
            "contest_json": None if self.budget is None else canonical_json(self.budget.to_json()).decode(),
        }

    def _witnessed(self, witnessing: Witnessing | None) -> str | None:
        if not self.witnesses:
            return None
        if witnessing is None:
            raise ValueError(f"track {self.name!r} names witnesses, and the server runs no operator log for them "
                             "(--operator-origin, --witness URL=VKEY, --drand URL, --drand-chain FILE)")
        keys = {NoteKey.parse(v).name: v for _, v in witnessing.witnesses}
        missing = [w for w in self.witnesses if w not in keys]
        if missing:
            raise ValueError(f"track {self.name!r} names witness(es) {', '.join(missing)} that the server is not "
                             f"configured with (it has {', '.join(keys) or 'none'})")
        quorum = len(self.witnesses) if self.quorum is None else self.quorum
        if not 1 <= quorum <= len(self.witnesses):
            raise ValueError(f"track {self.name!r}: quorum {quorum} of {len(self.witnesses)} witness(es)")
        chain = ChainInfo.from_json(witnessing.chain)
        return canonical_json({"witnesses": [keys[w] for w in self.witnesses], "quorum": quorum,
                               "operator": witnessing.vkey, "drand": {"url": witnessing.drand_url,
                                                                     "chain": chain.to_json()}}).decode()


@dataclass(frozen=True)
class Witnessing:
    """The operator log a leaderboard runs for its witnessed tracks: its origin and key, the witnesses it
    sends each checkpoint to (URL, note key) and how many must cosign one, and the drand chain (its
    endpoint and pinned information) the trainers take rounds from."""

    origin: str
    witnesses: tuple[tuple[str, str], ...]
    drand_url: str
    chain: dict
    quorum: int | None = None
    vkey: str = ""  # the operator log's note key (filled in by the server from its operator key)


# 99 % against 5 % bad steps over the tiny recipe's 60 steps: 1 - 0.01^(1/3) = 0.785
ONLINE_P_TINY = p_needed(0.99, 0.05, 60)

DEFAULT_TRACKS = (
    TrackSpec("tinygpt-stdlib-300", "tinygpt", {"steps": 300}, "bits_per_byte", False,
              "byte-level GPT (3.3 M parameters) on the Python standard library's sources, 300 steps; "
              "ranked by bits per byte on held-out stdlib files"),
    TrackSpec("tiny-mlp", "tiny", {}, "accuracy", True,
              "two-layer perceptron on a synthetic teacher, 60 steps; ranked by held-out accuracy"),
    TrackSpec("tiny-mlp-online", "tiny", {}, "accuracy", True,
              "the tiny-mlp recipe, audited online: the server's beacon selects steps while the run trains and its "
              "workers replay them as their states arrive", online_p=ONLINE_P_TINY),
)


def parse_track(text: str) -> TrackSpec:
    """``NAME=TASK[:KEY=VALUE,...][@METRIC[+|-]]``, e.g. ``quick=tiny:steps=20@accuracy+``; the fields
    ``online=P`` (online challenges required, with at least probability P), ``witnesses=A+B`` and
    ``quorum=K`` (those challenges drawn by drand and cosigned by K of the named witnesses),
    ``max_upload=BYTES`` (the track's upload limit), ``seeds=N`` (certified seeds a method needs to be
    ranked) and ``max_steps``, ``max_samples``, ``max_tokens``, ``max_params`` (a contest track: runs bring their own method
    within that budget, on the task's data) are not the recipe's."""
    name, sep, rest = text.partition("=")
    if not sep or not name:
        raise ValueError(f"a track is NAME=TASK[:KEY=VALUE,...][@METRIC+|-], not {text!r}")
    rest, _, metric = rest.partition("@")
    task, _, conf = rest.partition(":")
    config = {}
    for item in filter(None, conf.split(",")):
        k, eq, v = item.partition("=")
        if not eq:
            raise ValueError(f"bad recipe field {item!r}")
        try:
            config[k] = json.loads(v)
        except json.JSONDecodeError:
            config[k] = v
    higher = metric.endswith("+")
    metric = metric.rstrip("+-") or ("accuracy" if higher else "mean_loss")
    online = config.pop("online", None)
    if online is not None and (type(online) not in (int, float) or not 0 < online <= 1):
        raise ValueError(f"online=P takes a probability in (0, 1], not {online!r}")
    witnesses = config.pop("witnesses", None)
    quorum = config.pop("quorum", None)
    if witnesses is not None:
        witnesses = tuple(str(witnesses).split("+"))
        if online is None or not all(witnesses) or len(set(witnesses)) != len(witnesses):
            raise ValueError("witnesses=NAME+NAME... names each witness once, on a track with online=P")
    if quorum is not None and (witnesses is None or type(quorum) is not int or not 1 <= quorum <= len(witnesses)):
        raise ValueError(f"quorum=K takes 1 to the number of witnesses named, not {quorum!r}")
    limit = config.pop("max_upload", None)
    if limit is not None and (type(limit) is not int or not 1 <= limit <= 1 << 50):
        raise ValueError(f"max_upload=BYTES takes a positive number of bytes, not {limit!r}")
    seeds = config.pop("seeds", 3)
    if type(seeds) is not int or not 1 <= seeds <= 100:
        raise ValueError(f"seeds=N takes 1 to 100 certified seeds, not {seeds!r}")
    caps = {k: config.pop(k) for k in CAPS if k in config}
    budget = Budget(**caps) if caps else None
    built = build_task(task, config)  # fails now, not at the first submission
    if budget is not None and (online is not None or not getattr(built, "hides_targets", False)):
        raise ValueError("a contest track (max_steps, max_samples, max_tokens, max_params) is certified at submission, on a task "
                         "whose targets can be hidden from the method it scores; "
                         + ("online audits of submitted methods are not built" if online is not None else
                            f"task {task!r} cannot hide its targets"))
    about = f"{task} with {config or 'its default recipe'}" + (f", audited online (p >= {online:g})" if online else "") \
        + (f", drawn by drand and cosigned by {quorum or len(witnesses)} of {', '.join(witnesses)}" if witnesses else "")
    if budget is not None:
        about = f"contest on {task}'s data with {config or 'its default split'}: bring your own method, {budget.text()}"
    return TrackSpec(name, task, config, metric, higher, about, None if online is None else float(online), limit,
                     witnesses or (), quorum, seeds, budget)
