"""witness: certify neural-network training runs with signed logs and replay challenges."""

__version__ = "0.3.0"
