"""``witness serve``: a small HTTP server that answers for a bundle's final model.

JSON API (also in docs/serve.md):

* ``GET /v1/info`` → ``{"task", "final_model_hash", "served_model_hash", "probes"}``
* ``POST /v1/outputs`` with ``{"inputs": ["<hex of a probe input>", …]}`` (at most 64 inputs,
  1 MiB body) → ``{"outputs": nested float32 lists, "shape": […], "dtype": "float32"}``

It binds to loopback unless told otherwise, and answers malformed requests with 400.
"""

from __future__ import annotations

import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch

from ..bundle.reader import open_bundle
from ..bundle.state import load_state, model_hash
from ..commit.hashing import load_json
from ..verify.audit import task_of
from .evaluate import final_model
from .identity import read_weights

MAX_BODY = 1 << 20
MAX_INPUTS = 64


def make_server(bundle_dir: str | os.PathLike, host: str = "127.0.0.1", port: int = 0,
                weights: str | None = None) -> ThreadingHTTPServer:
    """An HTTP server for the bundle's final model (or for ``weights`` in its architecture)."""
    bundle = open_bundle(bundle_dir)
    task = task_of(bundle)
    model = final_model(bundle, task)
    if weights is not None:
        load_state(model, None, read_weights(weights))
    served = model_hash({f"model.{k}": v for k, v in model.state_dict().items()},
                        bundle.manifest.state_digest).hex()
    lock = threading.Lock()
    probe_len = len(task.probe_bytes()[0])
    info = {"task": task.name, "final_model_hash": bundle.end.final_model_hash.hex() if bundle.end else None,
            "served_model_hash": served, "probes": len(task.probe_bytes()), "input_bytes": probe_len}

    class Handler(BaseHTTPRequestHandler):
        server_version = "witness-serve/1"

        def _send(self, code: int, obj: dict) -> None:
            body = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:  # quiet: tests and scripts read stdout
            return

        def do_GET(self) -> None:  # noqa: N802
            if self.path == "/v1/info":
                self._send(200, info)
            else:
                self._send(404, {"error": "not found"})

        def do_POST(self) -> None:  # noqa: N802
            if self.path != "/v1/outputs":
                self._send(404, {"error": "not found"})
                return
            try:
                n = int(self.headers.get("Content-Length", "-1"))
            except ValueError:
                n = -1
            if not 0 <= n <= MAX_BODY:
                self._send(400, {"error": f"a request body of at most {MAX_BODY} bytes is required"})
                return
            try:
                req = load_json(self.rfile.read(n))
                inputs = [bytes.fromhex(x) for x in req["inputs"]]
                if not 1 <= len(inputs) <= MAX_INPUTS or any(len(x) != probe_len for x in inputs):
                    raise ValueError(f"send 1 to {MAX_INPUTS} inputs of {probe_len} bytes")
            except (ValueError, KeyError, TypeError) as e:
                self._send(400, {"error": f"bad request: {e}"})
                return
            with lock, torch.no_grad():
                out = task.probe_outputs(model, task.collate_probes(inputs)).to(torch.float32)
            self._send(200, {"outputs": out.tolist(), "shape": list(out.shape), "dtype": "float32"})

    return ThreadingHTTPServer((host, port), Handler)
