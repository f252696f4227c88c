"""``witness serve``: a small HTTP service (FastAPI on uvicorn) that answers for a bundle's final model.

The API is described in docs/serve.md and at ``/docs`` (OpenAPI):

* ``GET /v1/info`` → ``{"task", "final_model_hash", "served_model_hash", "probes", "input_bytes"}``
* ``POST /v1/outputs`` with ``{"inputs": ["<hex of a probe input>", …]}`` (at most 64 inputs)
  → ``{"outputs": nested float32 lists, "shape": […], "dtype": "float32"}``

It binds to loopback unless told otherwise. A body over 1 MiB gets 413, JSON nested deeper than
``MAX_DEPTH`` or of the wrong shape gets 400, before the model sees anything.
"""

from __future__ import annotations

import os
import threading

import torch
from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse

from .. import __version__
from ..bundle.reader import open_bundle
from ..bundle.state import load_state, model_hash
from ..commit.hashing import load_json
from ..verify.cheap import task_of
from ..web import BodyLimit, json_depth
from .evaluate import final_model
from .weights import read_weights

MAX_BODY = 1 << 20
MAX_INPUTS = 64
MAX_DEPTH = 4  # {"inputs": ["…"]} nests two levels; nothing the API takes nests deeper


class BadRequest(Exception):
    """A request the service refuses with 400."""


def _inputs(body: bytes, probe_len: int) -> list[bytes]:
    """The probe inputs of a request body, strictly checked."""
    if json_depth(body) > MAX_DEPTH:
        raise BadRequest(f"JSON nested deeper than {MAX_DEPTH} levels")
    try:
        req = load_json(body)
    except ValueError as e:
        raise BadRequest(str(e)) from None
    if not isinstance(req, dict) or set(req) != {"inputs"} or not isinstance(req["inputs"], list):
        raise BadRequest('send {"inputs": ["<hex>", …]}')
    raw = req["inputs"]
    if not 1 <= len(raw) <= MAX_INPUTS or not all(isinstance(x, str) and len(x) == 2 * probe_len for x in raw):
        raise BadRequest(f"send 1 to {MAX_INPUTS} inputs of {probe_len} bytes each, as hex")
    try:
        return [bytes.fromhex(x) for x in raw]
    except ValueError:
        raise BadRequest("an input is not hex") from None


def create_app(bundle_dir: str | os.PathLike, weights: str | None = None) -> FastAPI:
    """The service for the bundle's final model (or for ``weights`` in its architecture)."""
    bundle = open_bundle(bundle_dir)
    task = task_of(bundle)
    model = final_model(bundle, task)
    if weights is not None:
        load_state(model, None, read_weights(weights))
    served = model_hash({f"model.{k}": v for k, v in model.state_dict().items()},
                        bundle.manifest.state_digest).hex()
    lock = threading.Lock()  # one forward at a time: the model is shared by every request
    probe_len = len(task.probe_bytes()[0])
    info = {"task": task.name, "final_model_hash": bundle.end.final_model_hash.hex() if bundle.end else None,
            "served_model_hash": served, "probes": len(task.probe_bytes()), "input_bytes": probe_len}

    app = FastAPI(title="witness serve", version=__version__,
                  description="A run's final model, answering probe inputs for black-box identification.")

    @app.exception_handler(BadRequest)
    async def _bad(request: Request, e: BadRequest) -> JSONResponse:
        return JSONResponse({"error": f"bad request: {e}"}, 400)

    @app.get("/v1/info")
    def get_info() -> dict:
        """What is served: the task, the run's final model hash and the served model's hash."""
        return info

    @app.post("/v1/outputs")
    async def outputs(request: Request) -> dict:
        """The model's outputs on the given probe inputs (hex), as float32."""
        inputs = _inputs(await request.body(), probe_len)

        def forward() -> torch.Tensor:
            with lock:  # as the run's fingerprints were taken (a bf16 run answers from bf16 autocast)
                return task.recorded_probe_outputs(model, task.collate_probes(inputs))

        out = await run_in_threadpool(forward)
        return {"outputs": out.tolist(), "shape": list(out.shape), "dtype": "float32"}

    app.add_middleware(BodyLimit, limit=MAX_BODY)
    return app
