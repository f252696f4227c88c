"""The recorder: a few calls around the trainer's own loop that write a signed witness bundle."""

from ..commit.signing import load_or_create_key
from .link import OnlineSpec
from .options import Commitments, Online, SelfChecking, Training
from .recorder import Recorder


def start_run(*args, **kwargs):  # noqa: ANN002, ANN003, ANN201 - witness.distributed.loop.start_run's
    """Witness a loop in one line, in one process or under torchrun (``witness.distributed.loop``)."""
    # the façade's one door up: whether this is a torchrun process is found at run time
    from ..distributed.loop import start_run as start

    return start(*args, **kwargs)


__all__ = ["Commitments", "Online", "OnlineSpec", "Recorder", "SelfChecking", "Training", "load_or_create_key",
           "start_run"]
