"""The online-challenge beacon: it stamps a run's streamed tree heads with fresh, signed randomness.

One piece of code serves a lab or a reviewer on its own (``witness beacon serve``, SQLite by
default) and the leaderboard, which mounts the same routes and signs with its server key.
"""
