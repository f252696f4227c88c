"""What every benchmark shares: its command line and how it reports."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def parser(doc: str | None) -> argparse.ArgumentParser:
    """An argument parser with the shared ``--json`` option."""
    ap = argparse.ArgumentParser(description=(doc or "").splitlines()[0])
    ap.add_argument("--json", help="also write the figures to this file")
    return ap


def report(figures: dict, path: str | None) -> dict:
    """Print the figures as JSON, and write them to ``path`` if given."""
    text = json.dumps(figures, indent=2)
    print(text)
    if path:
        Path(path).write_text(text)
    return figures
