"""The recorder: a few calls around the trainer's own loop that write a signed witness bundle."""

from ..commit.signing import load_or_create_key
from .link import OnlineSpec
from .options import Commitments, Online, SelfChecking, Training
from .recorder import Recorder, start_run

__all__ = ["Commitments", "Online", "OnlineSpec", "Recorder", "SelfChecking", "Training", "load_or_create_key",
           "start_run"]
