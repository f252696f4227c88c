"""Detection rate of the cheap (interactive) audit against every attack class, against its bound.

For each attack the test suite mounts (tests/attacks.py: optimizer state steered onto another
model, a backdoor carried by AdamW's first moment, weights that neither the probes nor the sketch
see, a null-space nudge under tolerance mode, used data left out of the end record), a run of N
steps is made dishonest at a random 5 % of its steps, with a response of the trainer's own
making. It is audited many times with fresh nonces: with q = 90 challenges (the bound
1 - 0.95^90 >= 0.99) and with q = 10 (bound 0.40, where a shortfall would show). Every audit
also says whether its draw held a bad step: a drawn bad step that is not caught would be a hole
in the checks, where a low rate with none is the luck of the draw. A claimed world size makes
every step fail; it is in the test suite.

    python bench/attack_detection.py [--steps 200] [--audits 200] [--json out.json]
"""

from __future__ import annotations

import math
import random
import sys
import tempfile
import time
from pathlib import Path

from common import parser, report

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from attacks import KINDS, build  # noqa: E402 - the test suite's own attacks

from witness.bundle.reader import open_bundle  # noqa: E402
from witness.errors import RunRejected, VerificationError  # noqa: E402
from witness.verify import Evidence, Policy, Verifier  # noqa: E402
from witness.verify.challenges import detection_probability, draw_challenges  # noqa: E402
from witness.verify.response import Response  # noqa: E402


def audit(bundle: Path, response: Path, bad: set[int], q: int, audits: int, options: dict) -> dict:
    """Audit ``audits`` times with ``q`` challenges: the rate, the exact value, the bound, and how
    often a drawn bad step went uncaught (never, if the checks hold: then only the draw decides)."""
    opened, resp = open_bundle(bundle), Response(response)
    n = len(opened.steps)
    caught = drew = missed = replayed = 0
    started = time.perf_counter()
    for seed in range(audits):
        nonce = seed.to_bytes(4, "big")
        hit = {c.step for c in draw_challenges(opened.final_head, nonce, n, q)} & bad
        drew += bool(hit)
        try:
            policy = Policy(challenges=q, nonce=nonce, mode="interactive", bad_fraction=len(bad) / n, **options)
            v = Verifier(policy=policy).verify(opened, Evidence(response=resp))
            replayed += v.replayed_steps
            missed += bool(hit)
        except RunRejected as e:
            caught += 1
            replayed += e.verdict.replayed_steps
            if {r.step for r in e.verdict.results if not r.passed} != hit:
                raise AssertionError(f"the rejected steps are not the bad steps drawn: {e.failures}") from None
        except VerificationError:  # caught by a check made in full (the used-data trees): whatever is drawn
            caught += 1
    exact = 1 - math.comb(n - len(bad), q) / math.comb(n, q)
    return {"q": q, "audits": audits, "caught": caught, "rate": caught / audits, "exact": exact,
            "bound": detection_probability(len(bad) / n, q), "drew_a_bad_step": drew,
            "bad_step_drawn_but_missed": missed, "replayed_steps_per_audit": replayed / audits,
            "seconds_per_audit": (time.perf_counter() - started) / audits}


def main() -> dict:
    ap = parser(__doc__)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--bad-fraction", type=float, default=0.05)
    ap.add_argument("--audits", type=int, default=200)
    ap.add_argument("--audits-q90", type=int, default=50)
    args = ap.parse_args()
    out = {"steps": args.steps, "bad_fraction": args.bad_fraction, "attacks": {}}
    for kind in KINDS:
        rng = random.Random(kind)
        # bad steps leave the last one alone (a forged moment after it would steer nothing)
        bad = set(rng.sample(range(args.steps - 1), round(args.bad_fraction * args.steps)))
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            bundle, response, options = build(kind, Path(tmp), bad, args.steps)
            made = time.perf_counter() - t0
            rows = [audit(bundle, response, bad, q, a, options) for q, a in ((90, args.audits_q90), (10, args.audits))]
        out["attacks"][kind] = {"bad_steps": len(bad), "build_s": made, "audits": rows}
        print(kind, [(r["q"], r["rate"], round(r["bound"], 4)) for r in rows], file=sys.stderr, flush=True)
    return report(out, args.json)


if __name__ == "__main__":
    main()
