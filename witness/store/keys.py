"""The names of the objects a leaderboard keeps in its store, by run."""

from __future__ import annotations

EVALUATION = "evaluation.json"


# The objects a leaderboard keeps, by key. Each is written once, before the row that names it is
# committed (a crash in between leaves an object no row names, which the next start removes).
def archive_key(run_id: int) -> str:
    """The submission exactly as uploaded (served for download with its SHA-256)."""
    return f"runs/{int(run_id)}/submission.tar"


def evaluation_key(run_id: int) -> str:
    """The submission's evaluation certificate."""
    return f"runs/{int(run_id)}/{EVALUATION}"


def model_key(run_id: int) -> str:
    """The run's final model as released (written by a worker from the verified bundle)."""
    return f"runs/{int(run_id)}/model.safetensors"


def plot_key(run_id: int, name: str) -> str:
    """A plot drawn when the run was verified (``loss``, ``optimizer``, ``fingerprints``)."""
    return f"runs/{int(run_id)}/plots/{name}.svg"


def online_key(run_id: int, kind: str, step: int, sha256: str) -> str:
    """An online upload: the state before a selected step ("states"), its samples ("samples"), or a
    window's chunk openings ("chunks", by the head size the window closes at), named by its SHA-256
    too, so that an object is never replaced under the row that names it."""
    if kind not in ("states", "samples", "chunks") or len(sha256) != 64:
        raise ValueError(f"not an online upload: {kind} {sha256}")
    return f"{online_prefix(run_id, kind)}{int(step):08d}.{sha256}.{'json' if kind == 'samples' else 'safetensors'}"


def online_prefix(run_id: int, kind: str) -> str:
    """The keys of a run's online uploads of one kind start with this."""
    return f"online/{int(run_id)}/{kind}/"
