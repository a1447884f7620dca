"""The training step compiled for a GPU this machine does not have (tools/gpu_check.sh --offline).

    tools/gpu_check.sh --offline --arch 9.0                     # the record (bulk), for an H100
    tools/gpu_check.sh --offline --arch 8.9 --recipe mudd       # a 24 GiB Ada card
    tools/gpu_check.sh --offline --arch 9.0 --recipe all        # one row per recipe
    tools/gpu_check.sh --offline --arch sm_90 --preset tiny     # the toy size, in minutes
    tools/gpu_check.sh --offline --arch 8.0 --gpu_memory_gib=40 # the guard against 40 GiB per GPU

It needs torch's CUDA build (>= 2.11, requirements-gpu-stack.txt), Triton and a C compiler, and no
GPU: `PYTHON=.venv-gpu-stack/bin/python tools/gpu_check.sh --offline --arch 9.0`. For each recipe:

  1. the trainer's GPU guard (gpu_verdict) with the arch's properties (ARCHES: its usual memory, or
     --gpu_memory_gib) on the record's 8 GPUs: a configuration it refuses gets the guard's line
     (exit 2; a row with --recipe all) and is not compiled;
  2. in a process of its own, on a pretend `cuda:0` of that compute capability (fake tensors; a
     small C library, offline_gpu_shim.c, built into the check's temporary folder and preloaded,
     answers the CUDA runtime's and driver's questions), the graphs a run meets: the training step
     at step 0 (tied embedding, multi-token targets, the ramp's shortest slices) and at the last
     step (full batch, untied), each with its backward and the compiled optimizer updates, and one
     evaluation forward. Every Triton kernel is compiled to a cubin for the arch (every config
     inductor would time: nothing is timed or launched);
  3. the inventory: graphs, graph breaks and recompiles; Triton kernels, the largest shared memory
     and registers (with the kernel's name) against the arch's limits, local memory (cuobjdump)
     and the spills in it (ptxas -v), against inductor's spill threshold; the first
     compile error in one line with the flag that avoids it.

A table, then one JSON line (the GPU check's verdict). Exit code 0 when everything compiled within
the arch's limits, 1 when not, 2 for bad input (an unknown arch, flags, a missing tool, a recipe the
guard refuses). Its files (the shim, inductor's and Triton's caches) go to a temporary folder,
deleted at the end.

It proves that the step compiles for the arch and that every kernel fits it; not the numbers (no
kernel runs), NCCL, the speed, or the memory at run time (the guard's prediction only).
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import NamedTuple, Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import train_gpt_medium as tg  # noqa: E402
from tools.cli import first_line  # noqa: E402

SHIM_SOURCE = Path(__file__).with_name("offline_gpu_shim.c")
MIN_TORCH = (2, 11)
COMPILE_TIMEOUT_S = 3600  # the record's size takes minutes per recipe on a few cores
REGISTERS_PER_THREAD = 255
REGISTERS_PER_BLOCK = 65536


class Arch(NamedTuple):
    """What the offline compile pretends the GPU is: a usual card of that compute capability."""
    name: str
    memory_gib: float
    sms: int
    shared_per_block: int  # bytes a block may opt in to (the limit Triton checks a kernel against)
    shared_per_sm: int
    l2_bytes: int
    threads_per_sm: int


# NVIDIA's tuning guides' figures per architecture (maximum shared memory per block with opt-in, per SM)
ARCHES: dict[tuple[int, int], Arch] = {
    (7, 5): Arch("Tesla T4", 16, 40, 65_536, 65_536, 4 * 2**20, 1024),
    (8, 0): Arch("NVIDIA A100-SXM4-80GB", 80, 108, 166_912, 167_936, 40 * 2**20, 2048),
    (8, 6): Arch("NVIDIA A10", 24, 72, 101_376, 102_400, 6 * 2**20, 1536),
    (8, 9): Arch("NVIDIA L4", 24, 58, 101_376, 102_400, 48 * 2**20, 1536),
    (9, 0): Arch("NVIDIA H100 80GB HBM3", 80, 132, 232_448, 233_472, 50 * 2**20, 2048),
    (10, 0): Arch("NVIDIA B200", 180, 148, 232_448, 233_472, 126 * 2**20, 2048),
}


def arch_list() -> str:
    return ", ".join(f"{major}.{minor} ({arch.name})" for (major, minor), arch in ARCHES.items())


def parse_arch(text: Optional[str]) -> tuple[int, int]:
    """A compute capability as MAJOR.MINOR (9.0) or sm_XY (sm_90, sm_100) -> (major, minor), one of
    ARCHES; else ConfigError."""
    if not text:
        raise tg.ConfigError(f"--arch: --offline needs the compute capability to compile for, e.g. --arch 9.0 "
                             f"(H100); known: {arch_list()}")
    found = re.fullmatch(r"(\d+)\.(\d)", text) or re.fullmatch(r"sm_?(\d+)(\d)", text)
    if not found:
        raise tg.ConfigError(f"--arch: {text!r} is not a compute capability; give MAJOR.MINOR (9.0) or sm_XY "
                             f"(sm_90); known: {arch_list()}")
    capability = (int(found[1]), int(found[2]))
    if capability not in ARCHES:
        raise tg.ConfigError(f"--arch: compute capability {capability[0]}.{capability[1]} is not in the table of "
                             f"architectures (tools/offline_compile.py ARCHES: its memory, SMs, shared memory); "
                             f"known: {arch_list()}")
    return capability


def arch_gpu(capability: tuple[int, int]) -> tg.GpuProperties:
    arch = ARCHES[capability]
    return tg.GpuProperties(arch.name, capability, int(arch.memory_gib * 2**30))


def arch_environment(capability: tuple[int, int]) -> dict[str, str]:
    """The pretend GPU's properties for the shim (offline_gpu_shim.c reads them)."""
    arch = ARCHES[capability]
    return dict(OFFLINE_GPU_NAME=arch.name, OFFLINE_GPU_MAJOR=str(capability[0]), OFFLINE_GPU_MINOR=str(capability[1]),
                OFFLINE_GPU_MEMORY=str(int(arch.memory_gib * 2**30)), OFFLINE_GPU_SMS=str(arch.sms),
                OFFLINE_GPU_SHARED_PER_BLOCK=str(arch.shared_per_block), OFFLINE_GPU_SHARED_PER_SM=str(arch.shared_per_sm),
                OFFLINE_GPU_L2=str(arch.l2_bytes), OFFLINE_GPU_THREADS_PER_SM=str(arch.threads_per_sm))


# ---- what the machine needs: checked before anything is built


INSTALL = ("install the GPU stack: python3 -m venv .venv-gpu-stack && .venv-gpu-stack/bin/pip install -r "
           "requirements-gpu-stack.txt, then PYTHON=.venv-gpu-stack/bin/python tools/gpu_check.sh --offline ...")


def c_compiler() -> Optional[str]:
    """The C compiler Triton builds its driver module with, and the shim: $CC, else gcc, else clang."""
    named = os.environ.get("CC")
    if named:
        return shutil.which(named)
    return shutil.which("gcc") or shutil.which("clang")


def cuda_include_dirs() -> list[str]:
    """The CUDA runtime's headers for the shim, beside torch's CUDA build (the nvidia wheels), then
    Triton's (crt/host_defines.h, which the runtime wheel leaves out)."""
    import torch
    import triton
    site = Path(torch.__file__).resolve().parent.parent
    runtime = sorted(str(p.parent) for p in site.glob("nvidia/*/include/cuda_runtime_api.h"))
    for home in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if not runtime and home and (Path(home) / "include/cuda_runtime_api.h").exists():
            runtime = [str(Path(home) / "include")]
    return runtime + [str(Path(triton.__file__).resolve().parent / "backends/nvidia/include")] if runtime else []


def environment_problem() -> Optional[str]:
    """Why this machine cannot compile offline (a C compiler, torch's CUDA build >= 2.11, Triton,
    the CUDA runtime's headers), or None."""
    if c_compiler() is None:
        return ("--offline: no C compiler (Triton builds its driver module with one, and the check its pretend "
                "GPU): install gcc (apt-get install gcc) or name one in CC")
    import torch
    version = tuple(int(x) for x in re.findall(r"\d+", torch.__version__)[:2])
    if torch.version.cuda is None or version < MIN_TORCH:
        build = "a CPU build" if torch.version.cuda is None else "older than 2.11"
        return (f"--offline: this interpreter's torch {torch.__version__} is {build}; compiling for a GPU needs torch's "
                f"CUDA build >= 2.11: {INSTALL}")
    if not tg.importable("triton"):
        return f"--offline: Triton is not installed (torch's CUDA build brings it): {INSTALL}"
    if not cuobjdump().exists():
        return f"--offline: the Triton wheel has no cuobjdump ({cuobjdump()}): the kernels' registers cannot be read"
    if not cuda_include_dirs():
        return ("--offline: no CUDA runtime headers (cuda_runtime_api.h) beside torch's CUDA build or in CUDA_HOME; "
                f"reinstall the GPU stack: {INSTALL}")
    return None


def build_shim(folder: Path) -> Path:
    """offline_gpu_shim.c built as folder/libcuda.so.1; returns the file."""
    library = folder / "libcuda.so.1"
    command = [c_compiler(), "-shared", "-fPIC", "-O1", *(f"-I{d}" for d in cuda_include_dirs()),
               "-Wl,-soname,libcuda.so.1", "-o", str(library), str(SHIM_SOURCE)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"building the pretend GPU ({' '.join(command)}) failed: {done.stderr.strip()[-2000:]}")
    return library


def child_environment(capability: tuple[int, int], folder: Path, library: Path) -> dict[str, str]:
    """The variables of a child compiling for `capability`: the shim preloaded and found as libcuda.so.1,
    the arch's properties, and every cache and temporary file inside `folder`."""
    for name in ("inductor", "triton", "tmp"):
        (folder / name).mkdir(parents=True, exist_ok=True)
    preload = " ".join(filter(None, [str(library), os.environ.get("LD_PRELOAD")]))
    libraries = ":".join(filter(None, [str(library.parent), os.environ.get("LD_LIBRARY_PATH")]))
    return dict(arch_environment(capability), LD_PRELOAD=preload, LD_LIBRARY_PATH=libraries, CC=c_compiler(),
                TORCHINDUCTOR_CACHE_DIR=str(folder / "inductor"), TRITON_CACHE_DIR=str(folder / "triton"),
                TRITON_HOME=str(folder / "triton"), TMPDIR=str(folder / "tmp"), PYTHONDONTWRITEBYTECODE="1")


# ---- the child process: a pretend GPU, the compile, the inventory


class Compiled:
    """The Triton kernels compiled so far: per kernel (an inductor autotuner: one kernel of a graph),
    its name and the binaries of its configs (triton CompiledKernel)."""

    def __init__(self):
        self.kernels: list[tuple[str, list]] = []
        self.collecting: Optional[list] = None
        self.library = None  # the fake kernels added to torch's (kept alive: dropping it removes them)


def install_fake_gpu(compiled: Compiled) -> None:
    """torch.compile for the pretend cuda:0 on fake tensors: inductor's buffers fake, every Triton config
    compiled and none launched, nothing timed. Process-wide (the child process is this check's own)."""
    import torch
    import torch._C._dynamo.guards as guards
    import torch._inductor.config as inductor_config
    import triton
    from torch._inductor.runtime import benchmarking
    from torch._inductor.runtime import triton_heuristics
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    inductor_config.compile_threads = 1  # compiled here, so that every binary is seen (the machine is the limit)
    inductor_config.joint_graph_constant_folding = False  # it runs ops on the graph's constants
    # the compiled graphs' buffers: fake tensors, as their inputs (the C++ helpers make real ones)
    guards._empty_strided_cuda = lambda size, stride, dtype: torch.empty_strided(size, stride, dtype=dtype,
                                                                                 device="cuda:0")
    guards._empty_strided_cpu = lambda size, stride, dtype: torch.empty_strided(size, stride, dtype=dtype)
    guards._reinterpret_tensor = lambda t, size, stride, offset=0: t.as_strided(size, stride,
                                                                                t.storage_offset() + offset)
    # the compiled FP8 head calls _scaled_mm's out= form, which torch 2.11 has no fake kernel for: its
    # result's shape and dtype checked as the functional form's, written into `out`
    def scaled_mm_out(a, b, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None, use_fast_accum=False,
                      *, out):
        result = torch.ops.aten._scaled_mm.default(a, b, scale_a, scale_b, bias, scale_result, out_dtype,
                                                   use_fast_accum)
        assert (out.shape, out.dtype) == (result.shape, result.dtype), (out.shape, out.dtype)
        return out

    compiled.library = torch.library.Library("aten", "IMPL")
    compiled.library.impl("_scaled_mm.out", scaled_mm_out, "Meta")
    for cls in (benchmarking.Benchmarker, benchmarking.TritonBenchmarker, benchmarking.InductorBenchmarker):
        cls.benchmark_gpu = lambda self, *args, **kwargs: 1.0  # any choice: each one is compiled anyway

    compile_triton = triton.compile

    def compile_and_keep(*args, **kwargs):
        binary = compile_triton(*args, **kwargs)
        if compiled.collecting is not None:
            compiled.collecting.append(binary)
        return binary

    triton.compile = compile_and_keep
    Autotuner = triton_heuristics.CachingAutotuner
    compile_configs = Autotuner._precompile_worker

    def compile_every_config(self):
        if self.compile_results:
            return
        compiled.collecting = binaries = []
        try:
            compile_configs(self)
        finally:
            compiled.collecting = None
            compiled.kernels.append((self.fn.__name__, binaries))

    def precompile(self, warm_cache_only=False, reload_kernel=None, static_triton_bundle_key=None):
        with self.lock:  # no binary is loaded: there is no device to load it on
            self._precompile_worker()

    def run(self, *args, stream, benchmark_run=False, **kwargs):  # the launch: compiled, not launched
        self._precompile_worker()

    Autotuner._precompile_worker, Autotuner.precompile, Autotuner.run = compile_every_config, precompile, run
    # the model's modules are made on the meta device outside the fake mode (fake parameters refuse the
    # swap Module.to_empty makes); build_model then makes them fake cuda:0 tensors
    make_gpt = tg.GPT.__init__

    def gpt_outside_fake_mode(self, *args, **kwargs):
        with unset_fake_temporarily():
            make_gpt(self, *args, **kwargs)

    tg.GPT.__init__ = gpt_outside_fake_mode


# the trainer's functions by a part of their name (lower case, the first match wins) -> the flag that
# leaves them out (check_config names any flag it needs with it)
AVOIDING_FLAGS = (
    ("attend", "--attention=sdpa"),
    ("token_window", "--attention=sdpa"),
    ("fp8_up", "--fp8_mlp_up=false"),
    ("fp8up", "--fp8_mlp_up=false"),
    ("fp8_down", "--fp8_mlp_down=false"),
    ("fp8down", "--fp8_mlp_down=false"),
    ("fused", "--fused_softcap_ce=false"),
    ("fp8", "--fp8=false"),
    ("dc_", "--dc_layers="),
    ("dcband", "--dc_layers="),
    ("xsa", "--xsa_layers="),
    ("mudd_gate", "--mudd_gate=false"),
    ("mudd", "--mudd=false"),
)


def avoiding_flag(error: BaseException) -> Optional[str]:
    """The flag that leaves out the trainer's code where `error` was raised (its innermost frame in
    train_gpt_medium.py or triton_kernels.py, through the exceptions it was raised from), or None."""
    names = []
    while error is not None:
        names = [f.name for f in traceback.extract_tb(error.__traceback__)
                 if Path(f.filename).name in ("train_gpt_medium.py", "triton_kernels.py")] + names
        error = error.__cause__ or error.__context__
    for name in reversed(names):
        for part, flag in AVOIDING_FLAGS:
            if part in name.lower():
                return flag
    return None


def root_cause(error: BaseException) -> BaseException:
    """The exception `error` was raised from or while handling, and so on: the first that went wrong."""
    while (error.__cause__ or error.__context__) is not None:
        error = error.__cause__ or error.__context__
    return error


def cuobjdump() -> Path:
    """cuobjdump from the Triton wheel (its NVIDIA tools: ptxas, cuobjdump, nvdisasm)."""
    import triton
    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


def inductor_spill_threshold() -> int:
    """Inductor's spill threshold, in registers: when it times a kernel's configs it skips one whose
    Triton launcher reports more spilled registers (the cubin's local memory per thread / 4)."""
    from torch._inductor import config as inductor_config
    return inductor_config.triton.spill_threshold


def ptxas_spills(ptx: str, capability: tuple[int, int], folder: Path, fp_fusion: bool = True) -> dict[str, int]:
    """ptxas -v on a kernel's PTX, as Triton assembles it for the arch (its own ptxas; `.maxnreg` is
    in the PTX): the stack frame, and the bytes of registers spilled to it and loaded back, per
    thread. The cubin's local memory says only how big the frame is, not whether it holds spills."""
    from triton.backends.nvidia.compiler import get_ptxas
    path = folder / "kernel.ptx"
    path.write_text(ptx)
    target = re.search(r"^\s*\.target\s+(sm_\w+)", ptx, re.M).group(1)
    command = [get_ptxas(capability[0] * 10 + capability[1]).path, "-v", *([] if fp_fusion else ["--fmad=false"]),
               f"--gpu-name={target}", str(path), "-o", str(folder / "kernel.o")]
    out = subprocess.run(command, capture_output=True, text=True, check=True)
    found = re.findall(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", out.stdout + out.stderr)
    return dict(stack=max(int(f[0]) for f in found), spill_stores=max(int(f[1]) for f in found),
                spill_loads=max(int(f[2]) for f in found))


def resource_usage(cubin: bytes, folder: Path) -> dict[str, int]:
    """cuobjdump -res-usage of a kernel's cubin: REG, STACK, SHARED (static), LOCAL, ... as numbers."""
    path = folder / "kernel.cubin"
    path.write_bytes(cubin)
    out = subprocess.run([str(cuobjdump()), "-res-usage", str(path)], capture_output=True, text=True, check=True).stdout
    (line,) = [line for line in out.splitlines() if "REG:" in line]
    return {key: int(value) for key, value in re.findall(r"([A-Z]+(?:\[\d+\])?):(\d+)", line)}


def inventory(compiled: Compiled, capability: tuple[int, int], folder: Path) -> dict:
    """The kernels' resources against the arch's limits: counts, the largest shared memory (the launch's
    dynamic request and the cubin's static) and registers of any config with the kernel's name, the
    kernels none of whose configs fits the arch (Triton refuses to load one that does not, and
    inductor keeps the others), and the kernels all of whose configs use local memory (a stack
    frame), each with its least frame and what ptxas spilled into it: over inductor's spill
    threshold (it would skip every config; a failure) or within it (reported)."""
    arch = ARCHES[capability]
    folder.mkdir(parents=True, exist_ok=True)
    threshold_bytes = 4 * inductor_spill_threshold()
    binaries, unfit, over, within = [], [], [], []
    for kernel, configs in compiled.kernels:
        uses = []
        for binary in configs:
            use, meta = resource_usage(binary.asm["cubin"], folder), binary.metadata
            registers, local = use["REG"], use["LOCAL"] + use["STACK"]
            spilled = ptxas_spills(binary.asm["ptx"], capability, folder, getattr(meta, "enable_fp_fusion", True)) \
                if local else dict(stack=0, spill_stores=0, spill_loads=0)
            uses.append(dict(kernel=kernel, shared=meta.shared + use["SHARED"], num_warps=meta.num_warps,
                             registers=registers, local_bytes=local, **spilled,
                             fits=meta.shared + use["SHARED"] <= arch.shared_per_block and registers <= REGISTERS_PER_THREAD
                             and registers * 32 * meta.num_warps <= REGISTERS_PER_BLOCK))
        binaries += uses
        if uses and not any(u["fits"] for u in uses):
            unfit.append(min(uses, key=lambda u: u["shared"]))
        if uses and all(u["local_bytes"] for u in uses):
            least = min(uses, key=lambda u: u["local_bytes"])
            entry = [kernel, least["local_bytes"], least["spill_stores"], least["spill_loads"]]
            (over if least["local_bytes"] > threshold_bytes else within).append(entry)
    shared = max(binaries, key=lambda b: b["shared"], default=None)
    registers = max(binaries, key=lambda b: b["registers"], default=None)
    return dict(kernels=len(compiled.kernels), binaries=len(binaries), shared_limit=arch.shared_per_block,
                largest_shared=shared and dict(bytes=shared["shared"], kernel=shared["kernel"]),
                largest_registers=registers and dict(registers=registers["registers"], kernel=registers["kernel"],
                                                     num_warps=registers["num_warps"]),
                over_limits=[{k: u[k] for k in ("kernel", "shared", "registers", "num_warps")} for u in unfit],
                configs_over_limits=sum(not b["fits"] for b in binaries), spill_threshold_bytes=threshold_bytes,
                spills=over, spills_within_threshold=within,
                spilling_configs=sum(b["spill_stores"] > 0 for b in binaries))


def compile_step(argv: list[str], folder: Path) -> dict:
    """The child's work: the guard as a run applies it, then the step 0, last step and evaluation
    graphs on fake tensors of the pretend cuda:0; the report (compile counts, graph breaks, the
    kernels' inventory, the first error)."""
    import torch
    import torch._inductor.config as inductor_config
    from torch._dynamo.utils import counters
    from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode

    compiled = Compiled()
    install_fake_gpu(compiled)
    config = tg.parse_args(argv)
    device = torch.device("cuda", 0)
    tg.check_run_request(config, device)
    config = tg.check_gpu(config, device, tg.PEAK_WORLD_SIZE, [])  # the trainer's guard, as run_training applies it
    config = dataclasses.replace(config, val_tokens=config.batch_slices * config.val_seq_len)  # one evaluation step
    inductor_config.coordinate_descent_tuning = config.coordinate_descent_tuning
    report, error, phase, seconds = {}, None, "building the model", {}
    start = time.perf_counter()
    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            runner = tg.Runner(config, device)
            gen = torch.Generator().manual_seed(config.init_seed)
            last = config.num_iterations - 1
            for step, phase in ((0, "step 0"), (last, f"the last step ({last})")):
                if step == last and runner.split_step:
                    runner.model.untie_embedding(runner.optimizers)  # as after the split step
                batches, host_inputs = runner.random_step(gen, tg.slice_tokens(step, config))
                runner.train_step(step, batches, host_inputs=host_inputs)
                seconds[phase] = round(time.perf_counter() - start)
            phase = "evaluation"
            val_tokens = torch.randint(0, config.vocab_size, (config.val_tokens + 1,), generator=gen)
            try:
                runner.evaluate(config.num_iterations, val_tokens)
            except DataDependentOutputException:  # the losses' sum read on the host: compiled, nothing to read
                runner.model.train()
            seconds[phase] = round(time.perf_counter() - start)
    except Exception as e:  # the first compile error, in one line
        error = dict(phase=phase, error=first_line(root_cause(e)), flag=avoiding_flag(e))
    breaks = counters["graph_break"]
    report.update(tg.compile_counts(), graph_breaks=sum(breaks.values()),
                  break_reasons=[first_line_of(reason) for reason in breaks], seconds=seconds, error=error,
                  **inventory(compiled, config_capability(), folder / "cubins"))
    return report


def first_line_of(text: str) -> str:
    lines = str(text).strip().splitlines()
    return lines[0] if lines else ""


def config_capability() -> tuple[int, int]:
    return int(os.environ["OFFLINE_GPU_MAJOR"]), int(os.environ["OFFLINE_GPU_MINOR"])


def child_main(argv: list[str]) -> int:
    """`offline_compile.py FOLDER TRAINER_FLAGS...` in the environment child_environment makes (with the
    shim preloaded): the report as the last line, in JSON; exit 2 for flags the trainer refuses."""
    folder, flags = Path(argv[0]), argv[1:]
    try:
        report = compile_step(flags, folder)
    except tg.InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(child_main(sys.argv[1:]))
