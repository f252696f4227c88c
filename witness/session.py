"""One training state and the committed way to advance it: shared by recorder and verifier."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import sys
from typing import TypeVar

import torch

from .bundle.state import load_state, state_tensors
from .data.order import batch_indices, step_seed
from .fingerprint.chunks import alias_groups
from .fingerprint.probes import Fingerprint
from .fingerprint.sketch import ParameterSketch
from .task.base import StepOutput, Task
from .task.ranks import accumulation_replays, ranks_accumulated_step

T = TypeVar("T")

# MKL's Conditional Numerical Reproducibility modes (mkl_cbwr_get/set; MKL_CBWR_BRANCH = 1)
_CNR_NAMES = {1: "off", 2: "AUTO", 3: "COMPATIBLE", 4: "SSE2", 6: "SSE4_2", 7: "AVX", 8: "AVX2", 9: "AVX512_MIC",
              10: "AVX512", 11: "AVX512_MIC_E1", 12: "AVX512_E1"}


@functools.cache  # one lookup per process: pin_mkl and every recorder's and replayer's warn_mkl ask
def _mkl_cbwr() -> tuple | None:
    """MKL's get and set of its reproducible mode, from the libtorch that links it (None where
    torch has no MKL: ARM, macOS)."""
    path = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    try:
        lib = ctypes.CDLL(path)
        get, put = lib.mkl_serv_cbwr_get, lib.mkl_serv_cbwr_set
    except (OSError, AttributeError):
        return None
    for f in (get, put):
        f.restype, f.argtypes = ctypes.c_int, [ctypes.c_int]
    return get, put


def pin_mkl() -> str:
    """Put MKL in its run-to-run reproducible mode, unless MKL_CBWR already chose one; the mode in force.

    Without it (MKL's default, "off") MKL may take another code path for the same matrix product by
    the alignment of its operands in memory and its run-time dispatch, so two runs of one step on one
    machine may round a sum differently; AUTO keeps this CPU's fastest path and makes it the same
    every time (at a fixed thread count). MKL reads the mode at its first call: a process that
    multiplied matrices before witness was imported keeps "off" (``mkl_mode`` then says so)."""
    calls = _mkl_cbwr()
    if calls is None:
        return "no MKL"
    get, put = calls
    if get(1) == 1 and not os.environ.get("MKL_CBWR"):
        put(2)  # -8 once MKL has run: the mode can no longer change, and stays "off"
    return mkl_mode()


def mkl_mode() -> str:
    """MKL's reproducible mode in force in this process, in words ("off", "AUTO", ...; "no MKL")."""
    calls = _mkl_cbwr()
    if calls is None:
        return "no MKL"
    mode = calls[0](-1)
    name = _CNR_NAMES.get(mode & 0xFFFF, str(mode & 0xFFFF))
    return f"{name},STRICT" if mode & 0x10000 else name


def warn_mkl() -> None:
    """Say so where MKL runs without its reproducible mode (it multiplied matrices before witness
    was imported): a step may then round differently in replay than when it was recorded."""
    if mkl_mode() == "off":
        print("warning: MKL multiplied matrices before witness was imported, so its reproducible mode could not be "
              "set: a step may round differently when replayed. Import witness before torch's first matrix "
              "multiply, or set MKL_CBWR=AUTO in the environment", file=sys.stderr)


pin_mkl()  # as this module is imported: before the recorder or a verifier multiplies a matrix


class TrainingSession:
    """A model, its optimizer, and the seed-bound data order of one run.

    ``world_size`` > 1 replays a data-parallel run on one process: the global batch is split
    into the ranks' micro-batches in rank order, their gradients are accumulated in that order
    and divided by the world size, as DDP's all-reduce does.
    """

    def __init__(self, task: Task, run_seed: bytes, dataset_size: int, world_size: int = 1,
                 parallelism: str = "none", device: str | torch.device = "cpu"):
        self.task = task
        self.device = deterministic_device(device)
        self.parallelism = parallelism
        self.run_seed = run_seed
        self.dataset_size = dataset_size
        self.world_size = world_size
        if task.config.batch_size % world_size:
            raise ValueError(f"the global batch of {task.config.batch_size} does not split over {world_size} ranks")
        # initialised on the host (the same bits everywhere), then moved; the optimizer follows
        if world_size > 1 and task.compiles:
            raise ValueError("compile=True is for one process (a data-parallel step is replayed eagerly)")
        # a loop of its own under torchrun (DDP): each rank accumulates its grad_accum / world_size
        # micro-batches (witness.task.ranks)
        if not accumulation_replays(task.grad_accum, world_size, parallelism):
            raise ValueError(f"gradient accumulation over ranks is replayed for DDP with grad_accum a multiple of "
                             f"the world size (here {parallelism}, grad_accum {task.grad_accum}, {world_size} ranks)")
        if world_size > 1 and task.precision == "fp16":
            raise ValueError("fp16 with a GradScaler is for one process")
        self.model = task.build_model(run_seed).to(self.device)
        self.optimizer = task.build_optimizer(self.model)
        if task.precision == "fp16":  # its scale and growth tracker are committed with the optimizer's state
            self.optimizer.witness_scaler = torch.amp.GradScaler(self.device.type)
        self.step_model = task.step_model(self.model)  # compiled on its first step where the recipe compiles
        self.sketcher = ParameterSketch(run_seed, task.config.sketch_dims)

    def batch_indices(self, step: int) -> list[int]:
        """The committed batch of ``step``: a function of the run seed only."""
        return batch_indices(self.run_seed, step, self.task.config.batch_size, self.dataset_size)

    def batch_samples(self, step: int) -> list[bytes]:
        """The canonical bytes of the committed batch of ``step``, in order."""
        ds = self.task.dataset()
        return [ds.sample_bytes(i) for i in self.batch_indices(step)]

    def step_seed(self, step: int, micro: int = 0) -> int:
        """Seed of the randomness inside ``step`` (of micro-batch ``micro``)."""
        return step_seed(self.run_seed, step, micro)

    def micro_batches(self, samples: list[T]) -> list[list[T]]:
        """The global batch (samples or their indices) split into the ranks' micro-batches, in rank order."""
        b = len(samples) // self.world_size
        return [samples[r * b : (r + 1) * b] for r in range(self.world_size)]

    def lr(self, step: int) -> float:
        """The schedule's learning rate at ``step``."""
        return self.task.schedule.at(step)

    def step(self, step: int, samples: list[bytes]) -> StepOutput:
        """Run the committed step on the batch's canonical samples, exactly as recorded runs do."""
        # FSDP2 on one rank still clips by the norms of its shards (one shard: the whole tensor)
        if self.world_size == 1 and self.parallelism != "fsdp":
            batch = self.task.collate(samples)
            return self.task.train_step(self.step_model, self.optimizer, batch, self.lr(step), self.step_seed(step))
        if self.task.grad_accum > 1:  # each rank accumulated its share of the micro-batches (a loop's own, DDP)
            return ranks_accumulated_step(self.task, self.step_model, self.optimizer, self.task.collate(samples),
                                          self.lr(step), self.step_seed(step), self.world_size)
        micro = [self.task.collate(m) for m in self.micro_batches(samples)]
        seeds = [self.step_seed(step, r) for r in range(self.world_size)]
        return self.task.accumulated_step(self.step_model, self.optimizer, micro, self.lr(step), seeds,
                                          sharded_norm=self.parallelism == "fsdp")

    def fingerprint(self) -> Fingerprint:
        """Behavioral fingerprint of the current model."""
        return self.task.fingerprint(self.model)

    def sketch(self) -> list[float]:
        """Parameter sketch of the current model."""
        return self.sketcher(dict(self.model.named_parameters()))

    def state(self) -> dict[str, torch.Tensor]:
        """The whole training state as flat named tensors (``bundle.state.state_tensors``)."""
        return state_tensors(self.model, self.optimizer)

    def load(self, tensors: dict[str, torch.Tensor], step: int | None = None) -> None:
        """Put a flat state (the one after ``step`` updates) into the model and its optimizer."""
        load_state(self.model, self.optimizer, tensors)

    def parameter_names(self) -> list[str]:
        """The model's parameter names."""
        return [n for n, _ in self.model.named_parameters()]

    def aliases(self) -> list[tuple[str, ...]]:
        """Tied weights, by the task's own model (``bundle.state.alias_groups``)."""
        return alias_groups(self.model)



def deterministic_device(device: str | torch.device) -> torch.device:
    """The device to train or replay on, set up for deterministic kernels.

    On CUDA: deterministic algorithms only (an op without one raises instead of silently
    varying), the cuBLAS workspace setting those need, cuDNN without autotuning, no TF32, and
    attention without the fused kernels whose backward is not deterministic. The CPU needs none
    of it (its kernels are deterministic at a fixed thread count).
    """
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("--device cuda: this machine has no CUDA GPU that torch can use")
        # must be set before cuBLAS creates its handle; harmless if it already was
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.enable_flash_sdp(False)
        torch.backends.cuda.enable_mem_efficient_sdp(False)
        pin_collectives_and_tuning()
        refuse_fast_fp8()
    elif device.type != "cpu":
        raise ValueError(f"device {device}: witness records and replays on cpu or cuda")
    return device


# What exact replay needs of a GPU run beyond its kernels: NCCL's algorithm and protocol pinned (its
# tuner picks them by message size and topology, and NVLS and CollNet reduce in the switch, whose order
# differs between calls: NCCL issues #1497 and #2360), and no autotuning (inductor's and Triton's pick
# kernels by timing, which differ between machines and runs). Set where unset; a run that set another
# value keeps it, and the manifest records what was in effect.
COLLECTIVE_PINS = {"NCCL_ALGO": "Ring", "NCCL_PROTO": "Simple", "NCCL_NVLS_ENABLE": "0", "NCCL_COLLNET_ENABLE": "0",
                   "TORCHINDUCTOR_MAX_AUTOTUNE": "0", "TORCHINDUCTOR_COORDINATE_DESCENT_TUNING": "0"}


def pin_collectives_and_tuning() -> None:
    """Pin NCCL's algorithm and protocol, switch NVLS and CollNet off and autotuning off (before the
    process group and the first compile read them)."""
    for k, v in COLLECTIVE_PINS.items():
        os.environ.setdefault(k, v)
    try:
        from torch._inductor import config as inductor
    except ImportError:  # pragma: no cover - a torch without inductor
        return
    inductor.max_autotune = inductor.max_autotune_pointwise = inductor.max_autotune_gemm = False
    inductor.coordinate_descent_tuning = False


def collective_pins() -> str:
    """The pins in effect, as the manifest records them (``versions.device.pins``: ``algo=Ring proto=Simple
    nvls=0 collnet=0 autotune=0 cd_tuning=0``)."""
    short = ("algo", "proto", "nvls", "collnet", "autotune", "cd_tuning")
    return " ".join(f"{n}={os.environ.get(k, '')[:16]}" for n, k in zip(short, COLLECTIVE_PINS, strict=True))


def refuse_fast_fp8() -> None:
    """FP8 matrix products with fast accumulation (``torch._scaled_mm(..., use_fast_accum=True)``) add in
    an order the hardware chooses: a run that claims exact replay refuses them where they are called."""
    scaled = getattr(torch, "_scaled_mm", None)
    if scaled is None or getattr(scaled, "_witness_guard", False):
        return

    def guarded(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - torch's own signature
        if kwargs.get("use_fast_accum") or (len(args) > 7 and args[7]):
            raise RuntimeError("an FP8 matrix product with use_fast_accum=True does not replay exactly: witness "
                               "records and replays without fast accumulation (use_fast_accum=False)")
        return scaled(*args, **kwargs)

    guarded._witness_guard = True  # type: ignore[attr-defined]
    torch._scaled_mm = guarded


# The CPU features that choose torch's CPU kernels: ATen's vectorised kernels follow its capability
# level, oneDNN the ISA extensions, and MKL the vendor as well; MKL_CBWR and DNNL_MAX_CPU_ISA
# override the last two. Two CPUs that differ in any of them may round differently: ATen's
# portable kernels against its AVX2 ones change a tinygpt step's bits (measured).
KERNEL_FLAGS = frozenset({"avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512dq", "avx512vl",
                          "avx512_vnni", "avx512_bf16", "avx512_fp16", "avx_vnni", "amx_tile", "amx_bf16",
                          "amx_int8", "amx_fp16", "asimd", "asimdhp", "sve", "sve2", "bf16", "i8mm"})
KERNEL_ENV = ("MKL_CBWR", "DNNL_MAX_CPU_ISA")


def cpu_kernels() -> str:
    """This CPU's kernel choice in words: vendor, ATen capability, ISA extensions, library overrides."""
    return _fit(kernel_words())


def kernel_words() -> str:
    """``cpu_kernels`` at any length."""
    vendor, flags = platform.processor() or "unknown", set()
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "vendor_id":
                    vendor = value.strip()
                elif key.strip() in ("flags", "Features"):
                    flags = set(value.split())
                    break
    except OSError:  # not Linux: the vendor string and torch's own capability
        pass
    pins = [f"{k}={os.environ[k]}" for k in KERNEL_ENV if os.environ.get(k)]
    return " ".join([vendor, torch.backends.cpu.get_cpu_capability(), *sorted(flags & KERNEL_FLAGS), *pins])


KERNELS_MAX = 128  # what the manifest's schema allows a device field


def _fit(words: str) -> str:
    """The kernel choice in at most ``KERNELS_MAX`` characters: a longer one (a CPU with many of the
    extensions above, and library pins) keeps its start and ends with a hash of the whole, so two
    choices never read the same. Releases before 0.5 cut it off instead."""
    if len(words) <= KERNELS_MAX:
        return words
    return f"{words[:KERNELS_MAX - 18].rstrip()} #{hashlib.sha256(words.encode()).hexdigest()[:16]}"


def _legacy(words: str) -> str:
    return words[:KERNELS_MAX]


def compiler_version(device: str | torch.device = "cpu") -> str:
    """What ``torch.compile`` generates a device's kernels with: the C++ compiler inductor uses for a
    CPU (its ``--version`` line), Triton's release for a GPU."""
    if torch.device(device).type == "cuda":
        import triton  # type: ignore[import-not-found]

        return f"triton {triton.__version__}"
    import subprocess

    from torch._inductor.cpp_builder import get_cpp_compiler

    cxx = get_cpp_compiler()
    out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30, check=False).stdout
    return (out.splitlines() or [cxx])[0].strip()[:128]


def device_info(device: str | torch.device = "cpu", compiled: bool = False) -> dict[str, str]:
    """What the manifest records about the hardware and libraries a run's kernels came from (and,
    for a run whose step is compiled, the compiler of its kernels)."""
    info = _device_info(device)
    if compiled:
        info["compiler"] = compiler_version(device)
    return info


def _device_info(device: str | torch.device = "cpu") -> dict[str, str]:
    device = torch.device(device)
    if device.type != "cuda":
        return {"kind": "cpu", "machine": platform.machine() or "unknown", "kernels": cpu_kernels()}
    index = device.index if device.index is not None else torch.cuda.current_device()
    # the host's kernels too: the weights are drawn on the host (randn's kernels differ by CPU)
    info = {"kind": "cuda", "name": torch.cuda.get_device_name(index), "cuda": str(torch.version.cuda),
            "cudnn": str(torch.backends.cudnn.version()), "kernels": cpu_kernels(), "pins": collective_pins()}
    nccl = getattr(torch.cuda, "nccl", None)
    if nccl is not None and torch.distributed.is_nccl_available():
        info["nccl"] = ".".join(map(str, nccl.version())) if isinstance(nccl.version(), tuple) else str(nccl.version())
    try:  # the driver version, where NVML can tell it
        import pynvml  # type: ignore[import-not-found]

        pynvml.nvmlInit()
        info["driver"] = str(pynvml.nvmlSystemGetDriverVersion())
    except Exception:  # noqa: BLE001 - optional: the name and library versions decide replay
        pass
    return info


def same_hardware(recorded: dict[str, str], here: dict[str, str]) -> bool:
    """Whether bit-exact replay may be expected: the same device kind and host CPU kernel choice
    (the initial weights are drawn on the host); for a CPU the same architecture; for a GPU the
    same model and CUDA and cuDNN releases (the driver does not choose kernels). A field the run
    did not record (an older release) is not compared. This decides only what to attempt: exact
    replay still has to match every bit."""
    gpu = ("kind", "name", "cuda", "cudnn", "kernels", "compiler", "nccl", "pins")
    keys = ("kind", "machine", "kernels", "compiler") if recorded.get("kind") == "cpu" else gpu
    # a run of a release before 0.5 names a long kernel choice cut off where this one hashes its tail:
    # only a cut one (KERNELS_MAX characters) read on this machine (``here`` is its own) is read so
    return all(recorded[k] == here.get(k) or (k == "kernels" and len(recorded[k]) == KERNELS_MAX
                                              and here.get(k) == cpu_kernels()
                                              and recorded[k] == _legacy(kernel_words()))
               for k in keys if k in recorded)


def describe_device(info: dict[str, str]) -> str:
    """A device record in words."""
    compiler = f"; compiled by {info['compiler']}" if "compiler" in info else ""
    if info.get("kind") != "cuda":
        kernels = f"; {info['kernels']}" if "kernels" in info else ""
        return f"the CPU ({info.get('machine', 'unknown architecture')}{kernels}{compiler})"
    host = f", host {info['kernels']}" if "kernels" in info else ""
    return f"{info.get('name', 'a GPU')} (CUDA {info.get('cuda', '?')}, cuDNN {info.get('cudnn', '?')}{host}{compiler})"


def torch_version() -> str:
    """The torch release (without a local build tag): exact replay needs the same kernels."""
    return torch.__version__.split("+")[0]


def cpu_cores() -> int:
    """CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def bounded_threads(threads: int) -> int:
    """A thread count asked for by a person, refused above the machine's cores (more only
    starves the machine: OpenMP starts that many threads)."""
    cores = cpu_cores()
    if not 1 <= threads <= cores:
        raise ValueError(f"--threads {threads}: this machine has {cores} core(s); use 1 to {cores}")
    return threads
