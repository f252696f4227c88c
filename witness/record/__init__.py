"""The recorder: a few calls around the trainer's own loop that write a signed witness bundle."""

from .recorder import Recorder

__all__ = ["Recorder"]
