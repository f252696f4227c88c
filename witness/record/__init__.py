"""The recorder: a few calls around the trainer's own loop that write a signed witness bundle."""

from ..commit.signing import load_or_create_key
from .loop import start_run
from .recorder import Recorder

__all__ = ["Recorder", "load_or_create_key", "start_run"]
