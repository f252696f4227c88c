"""witness: certify neural-network training runs with signed logs and replay challenges."""

__version__ = "0.5.0"

# The releases whose runs this one replays bit for bit: it builds their recipes into the same
# tasks and steps them with the same training code, data order and state commitments. A release
# that changes any of these for existing recipes starts the list afresh; one that only adds (a
# field at its default, a new digest name) keeps it. Every listed older release has a bundle it
# recorded under tests/data that this release must verify. The verifier decides from this list,
# never from the bundle.
REPLAYS_RUNS_OF = ("0.3.0", "0.4.0", __version__)


def replays(release: str) -> bool:
    """Whether this release replays runs recorded by ``release`` bit for bit."""
    return release in REPLAYS_RUNS_OF
