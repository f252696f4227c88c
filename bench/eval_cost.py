"""Evaluation certificates: verify-eval (M = 100 spot checks) against a full re-evaluation, and
certificate size against the number of examples.

    python bench/eval_cost.py [--json out.json]
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch
from common import parser, report

from witness.bundle.reader import open_bundle
from witness.commit.hashing import canonical_json
from witness.commit.signing import generate_key
from witness.evals.evaluate import evaluate, final_model, verify_eval
from witness.record import Commitments, Recorder
from witness.task import build_task
from witness.verify.cheap import task_of

BASE = {"steps": 20, "n_layer": 2, "d_model": 128}


def main() -> dict:
    ap = parser(__doc__)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    sizes = []
    timing = {}
    with tempfile.TemporaryDirectory() as tmp:
        for limit in (1_000_000, 4_000_000, 0):
            task = build_task("tinygpt", dict(BASE, corpus_max_bytes=limit))
            run = Path(tmp) / f"run{limit}"
            Recorder.create(task, run, generate_key(), r=b"\x03" * 32,
                            commit=Commitments(checkpoint_every=10)).train(progress=False)
            start = time.perf_counter()
            cert = evaluate(run, generate_key(), progress=False)
            eval_s = time.perf_counter() - start
            n = cert["results"]["count"]
            size = len(canonical_json(cert))
            sizes.append({"examples": n, "eval_documents": len(cert["contamination"]["documents"]),
                          "certificate_bytes": size, "bytes_per_example": size / n})
            if limit == 0:
                bundle = open_bundle(run)
                t = task_of(bundle)
                model = final_model(bundle, t)
                ds = t.eval_dataset()
                start = time.perf_counter()
                for i in range(len(ds)):
                    t.eval_example(model, ds.sample_bytes(i))
                reeval_s = time.perf_counter() - start
                start = time.perf_counter()
                verify_eval(cert, run, spots=100, nonce=b"bench")
                verify_s = time.perf_counter() - start
                timing = {"examples": n, "full_reevaluation_s": reeval_s, "evaluate_with_proofs_s": eval_s,
                          "verify_eval_m100_s": verify_s, "verify_eval_vs_full_reevaluation": verify_s / reeval_s}
    return report({"cost": timing, "sizes": sizes}, args.json)


if __name__ == "__main__":
    main()
