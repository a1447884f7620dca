"""Each Triton kernel of triton_kernels.py compiled ahead of time, on this CPU, for the GPUs the
trainer targets (compute capability 8.0 A100, 8.9 Ada, 9.0 Hopper, 10.0 Blackwell) exactly as the
trainer launches it: the launches are recorded at the trainer's own call sites (GPT.loss with
--fused_softcap_ce, the FP8 head's backward) for each configuration that reaches a kernel, and each
is compiled by the kernel's own JIT launcher (its warmup: the dtypes, constexprs and num_warps passed
and the specialization Triton adds to them). Each must fit the architecture's opt-in shared memory
and its register file, with no local memory (no spills), as cuobjdump -res-usage (in the triton
wheel) reads the cubin. A launch that cannot compile for an architecture must be one the trainer's
GPU guard refuses there. This compiles; it runs no kernel (tests/test_fused_ce.py and
tests/test_fp8_head.py check the kernels' numbers under Triton's interpreter)."""
import itertools
import types
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton", reason="triton is not installed: no kernel can be compiled for a GPU")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime.driver import driver  # noqa: E402

import train_gpt_medium as tg  # noqa: E402
from tools import offline_compile as offline  # noqa: E402
import triton_kernels as kernels  # noqa: E402

# The most shared memory a block may opt into, bytes: the CUDA C++ Programming Guide's table
# "Technical Specifications per Compute Capability", row "Maximum amount of shared memory per thread
# block" (8.0: 163 KB; 8.6, 8.9: 99 KB; 9.0, 10.0: 227 KB): the SM's 164, 100, 228 KB less the 1 KB
# the driver reserves per block, as NVIDIA's CCCL (arch_traits.cuh, max_shared_memory_per_block_optin)
# and CUTLASS (sm100_smem_capacity_bytes = 232,448) have them.
OPT_IN_SHARED_MEMORY = {80: 166_912, 89: 101_376, 90: 232_448, 100: 232_448}
REGISTERS_PER_BLOCK = 65_536  # on each of them (the same table)
CUOBJDUMP = offline.cuobjdump()

# the trainer compiles its kernels under the same default (triton 3.9 warns that 3.10 changes it)
pytestmark = pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")


# ---- the launches, recorded at the trainer's call sites

@dataclass
class Launch:
    """A kernel's launch as its launcher made it (the kernel: the JIT function itself) and the
    configurations that made it: (their flags and step, their Hyperparameters)."""
    kernel: object
    grid: tuple
    args: tuple
    kwargs: dict
    configs: list = field(default_factory=list)

    def named(self) -> list[tuple[str, object]]:
        return list(zip(self.kernel.arg_names, self.args)) + list(self.kwargs.items())

    def key(self, *leave_out: str) -> tuple:
        """What of the launch can reach the compiled kernel (less the arguments named): a tensor's
        dtype (its address is a multiple of 16: stand_in), a float's type (Triton does not specialize
        floats), any other value itself (an int: its divisibility by 16; a constexpr)."""
        what = lambda v: v.dtype if torch.is_tensor(v) else float if isinstance(v, float) else v
        return (self.kernel, tuple((name, what(v)) for name, v in self.named() if name not in leave_out))

    def __str__(self) -> str:
        """The kernel, its tensors' dtypes, its integers and constexprs (floats are not specialized)."""
        shown = [f"{name} {str(v.dtype).removeprefix('torch.')}" if torch.is_tensor(v) else f"{name}={v}"
                 for name, v in self.named() if not isinstance(v, float) and v is not None]
        return f"{self.kernel.fn.__name__}({', '.join(shown)})"


class OnCuda(torch.Tensor):
    """A CPU tensor that says it is on CUDA: the launchers' callers take their CUDA branch for it."""

    @property
    def is_cuda(self):
        return True


def stand_in(value):
    """A launch's argument as a compile needs it: a tensor by 16 elements of its dtype (Triton
    specializes a pointer on its dtype and on its address being a multiple of 16, as each tensor's
    launched here is: asserted), so the recording keeps no (T, V) tensor; anything else as it is."""
    if not torch.is_tensor(value):
        return value
    assert value.data_ptr() % 16 == 0, "a launch passes a tensor at an address Triton specializes apart"
    return torch.empty(16, dtype=value.dtype)


class Recorder:
    """Stands where a kernel stands: kernel[grid](*args, **kwargs) records the launch."""

    def __init__(self, kernel, made: list, config: list):
        self.kernel, self.made, self.config = kernel, made, config

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.made.append(Launch(
            self.kernel, grid, tuple(map(stand_in, args)), {k: stand_in(v) for k, v in kwargs.items()},
            [self.config[0]]))


# What reaches a kernel: the recipes with the fused loss (bigram: pr252's two kernels; mudd: pr261's
# one-pass kernel), with and without --fp8 (the gradient's e5m2 codes, and the FP8 head's transpose of
# them), in either model dtype, with and without #337's prefix column (--prefix_loss_weight, as the
# transfer candidate sets it), at each phase of the multi-token schedule (3, 2, 1 weights: the
# constexpr K); and fp8_yarn's FP8 head, the transpose's other caller.
FUSED_RECIPES = [name for name in tg.RECIPES if tg.make_config(recipe=name).fused_softcap_ce]
FLAGS = dict(fp8=(True, False), dtype=("bfloat16", "float32"),
             prefix_loss_weight=(0.0, tg.TRANSFER_IDEAS["prefix_loss_weight"]))
# a slice's tokens are a multiple of --attn_block_size: of 16 at the default 128, of nothing at
# others (Triton specializes an integer argument on its divisibility by 16)
SLICE_TOKENS = (16, 24)
MODEL_DIM = 4  # the head's input width: no kernel is given it


def schedule_phases(config) -> dict:
    """The first step of each phase of the multi-token schedule and, with --prefix_loss_weight, of
    #337's prefix term: {(the number of weights, whether the prefix term is on): step}."""
    phases = {}
    for step in range(config.num_iterations):
        prefixed = bool(config.prefix_loss_weight) and tg.prefix_loss_weight_at(step, config) is not None
        phases.setdefault((len(tg.multi_token_weights(step, config)), prefixed), step)
    return phases


def head_weight(config) -> torch.Tensor:
    """The head as the model stores it (zeros: no value reaches a launch, and no random state is used)."""
    V = config.padded_vocab_size
    return torch.zeros((MODEL_DIM, V) if config.head_transposed else (V, MODEL_DIM))


def fused_loss_step(config, step: int, T: int) -> None:
    """The training loss of `step` on T tokens, forward and backward, through GPT.loss (which reads
    only the model's config, training flag, prefix table and head weight): the multi-token weights
    as Runner.train_step passes them, the prefix term on or off as the model sets it at that step
    (its table unfilled: a column of no targets, the launches' shapes all the same)."""
    mtp = tg.Runner.mtp_input(types.SimpleNamespace(mtp_buffer=torch.zeros(0), device="cpu"),
                              tg.multi_token_weights(step, config))
    prefix = tg.PrefixTargets(config) if config.prefix_loss_weight else None
    if prefix is not None:
        prefix.set_step(step)
    model = types.SimpleNamespace(config=config, training=True, prefix=prefix,
                                  head=types.SimpleNamespace(weight=head_weight(config)))
    x = torch.zeros(T, MODEL_DIM, dtype=getattr(torch, config.dtype), requires_grad=True)
    targets = torch.arange(T)
    tg.GPT.loss(model, x, targets, 1, config.train_loss_reduction, False, mtp).backward()


def fp8_head_step(config, T: int) -> None:
    """--fp8 without the fused loss (fp8_yarn): the FP8 head's product on T tokens, forward and backward."""
    x = torch.zeros(T, MODEL_DIM, dtype=torch.bfloat16, requires_grad=True)
    tg.FP8HeadProduct.apply(x, head_weight(config), config.head_transposed,
                            tg.fp8_training_scales(config)).sum().backward()


@pytest.fixture(scope="module")
def launches() -> list[Launch]:
    """Each distinct launch of the configurations above, with every configuration that made it. The
    kernels (and the helpers they call) are made afresh for this file and put back after it, so what
    they compile here goes with them."""
    made, current = [], [None]  # current: the configuration being recorded
    with pytest.MonkeyPatch.context() as mp:
        for name in ("_FUSED_CE_KERNELS", "_TRANSPOSE_KERNEL", "bf16_rounded", "row_lse_and_loss", "block_terms",
                     "pr261_gradient"):
            mp.setattr(kernels, name, None)
        fused, transpose = kernels._fused_ce_kernels(), kernels.fp8_transpose_kernel()
        mp.setattr(kernels, "_FUSED_CE_KERNELS", tuple(Recorder(k, made, current) for k in fused))
        mp.setattr(kernels, "_TRANSPOSE_KERNEL", Recorder(transpose, made, current))
        logits, transposed = kernels._fused_ce_logits, kernels.fp8_transpose
        mp.setattr(kernels, "_fused_ce_logits", lambda *args: logits(*args).as_subclass(OnCuda))
        mp.setattr(kernels, "fp8_transpose", lambda codes: transposed(codes.as_subclass(OnCuda)))
        for recipe, values in itertools.product(FUSED_RECIPES, itertools.product(*FLAGS.values())):
            flags = dict(zip(FLAGS, values))
            config = tg.make_config(recipe=recipe, **flags)
            text = f"--recipe {recipe} " + " ".join(f"--{k}={v}" for k, v in flags.items())
            for (k, prefixed), step in schedule_phases(config).items():
                current[0] = (f"{text} at step {step} ({k} weights{', the prefix term' * prefixed})", config)
                fused_loss_step(config, step, SLICE_TOKENS[0])
        fp8_head = tg.make_config(recipe="fp8_yarn")
        for T in SLICE_TOKENS:
            current[0] = (f"--recipe fp8_yarn, {T} tokens", fp8_head)
            fp8_head_step(fp8_head, T)
        for name, value in (("_FUSED_CE_KERNELS", fused), ("_TRANSPOSE_KERNEL", transpose),
                            ("_fused_ce_logits", logits), ("fp8_transpose", transposed)):
            mp.setattr(kernels, name, value)  # the kernels themselves again, while this file runs
        unique = {}
        for launch in made:
            unique.setdefault(launch.key(), Launch(launch.kernel, launch.grid, launch.args, launch.kwargs)).configs \
                += launch.configs
        yield list(unique.values())


def most_terms(launches: list[Launch]) -> list[Launch]:
    """Of launches that differ only in K, the one with the most terms: K is a row's loss terms, a
    loop of scalar loads and column compares that Triton unrolls K times, so fewer terms are the same
    code unrolled less (shared memory, a reduction over BLOCK columns, does not depend on K). Every K
    would double this file's time; compiled so once (triton 3.9), each K of each launch used 24 to 56
    registers a thread and no local memory, though not always the most at the most terms."""
    most = {}
    for launch in launches:
        key = launch.key("K")
        if key not in most or launch.kwargs.get("K", 0) > most[key].kwargs.get("K", 0):
            most[key] = launch
    return list(most.values())


# ---- compiled for each target

class CompileOnly:
    """Triton's driver as a JIT launcher's warmup asks it: the target to compile for (this machine
    need have no GPU) and a device key of its own, so the launcher's in-process cache starts empty."""

    def __init__(self, capability: int):
        self.target = GPUTarget("cuda", capability, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return f"compile only, sm_{self.target.arch}"

    def get_current_stream(self, device):
        return None


def refusals(config, gpu: tg.GpuProperties) -> list:
    """What the trainer's GPU guard (gpu_verdict) refuses of config on this GPU for lack of a feature
    (the guard's memory check aside: these GPUs are the architectures, of any memory)."""
    return tg.gpu_feature_problems(tg.auto_choices(config, gpu)[0], gpu)


@dataclass
class Target:
    """most_terms(launches) compiled for one architecture: (launch, compiled kernel or the error) each."""
    capability: int
    results: list
    folder: Path

    @property
    def gpu(self) -> tg.GpuProperties:
        major, minor = divmod(self.capability, 10)
        return tg.GpuProperties(f"a GPU of compute capability {major}.{minor}", (major, minor), 80 * 2**30)


@pytest.fixture(scope="module")
def compiled_for(launches, tmp_path_factory):
    """compiled_for(capability): the launches compiled for it, once per file, into an empty Triton
    cache (a warm one would hide a failure to compile)."""
    if not CUOBJDUMP.exists():
        pytest.skip(f"cuobjdump is not in this triton wheel ({CUOBJDUMP}): the cubins' spills cannot be read")
    done = {}

    def compile_for(capability: int) -> Target:
        if capability not in done:
            folder = tmp_path_factory.mktemp(f"sm_{capability}")
            results = []
            with pytest.MonkeyPatch.context() as mp:
                mp.setenv("TRITON_CACHE_DIR", str(folder / "cache"))
                mp.setattr(driver, "_active", CompileOnly(capability))
                for launch in most_terms(launches):
                    try:
                        results.append((launch, launch.kernel.warmup(*launch.args, grid=launch.grid, **launch.kwargs)))
                    except Exception as error:  # noqa: BLE001 - a failure to compile is what is looked for
                        results.append((launch, error))
            done[capability] = Target(capability, results, folder)
        return done[capability]
    return compile_for


def test_the_trainer_launches_every_kernel_of_triton_kernels(launches):
    """The recording reaches each kernel (so each is compiled below): rows and gradient (pr252), the
    one-pass kernel (pr261), the transpose (--fp8); and each K the schedule and prefix term give."""
    made = {k.fn.__name__ for k in (*kernels._fused_ce_kernels(), kernels.fp8_transpose_kernel())}
    assert {launch.kernel.fn.__name__ for launch in launches} == made == {
        "rows_kernel", "dlogits_kernel", "rows_dlogits_kernel", "transpose_kernel"}
    assert {launch.kwargs.get("K") for launch in launches} == {None, 1, 2, 3, 4}


@pytest.mark.parametrize("capability", OPT_IN_SHARED_MEMORY)
def test_each_launch_compiles_within_the_shared_memory_and_registers_without_spills(capability, compiled_for):
    """For each architecture: each launch compiles unless the guard refuses every configuration that
    makes it there; compiled, its shared memory (the launch's dynamic request and the cubin's static)
    is within the opt-in limit, its registers within the block's, and it has no local memory."""
    target = compiled_for(capability)
    problems = []
    for launch, kernel in target.results:
        if isinstance(kernel, Exception):
            allowed = [text for text, config in launch.configs if not refusals(config, target.gpu)]
            if allowed:
                problems.append(f"{launch} does not compile ({str(kernel).splitlines()[-1]}), yet on "
                                f"{target.gpu.name} the guard lets {allowed[0]} run, which launches it")
            continue
        use = offline.resource_usage(kernel.asm["cubin"], target.folder)
        shared, threads = kernel.metadata.shared + use["SHARED"], kernel.metadata.num_warps * 32
        if shared > OPT_IN_SHARED_MEMORY[capability]:
            problems.append(f"{launch}: {shared:,} B of shared memory, more than {OPT_IN_SHARED_MEMORY[capability]:,}")
        if use["REG"] * threads > REGISTERS_PER_BLOCK:
            problems.append(f"{launch}: {use['REG']} registers x {threads} threads, more than {REGISTERS_PER_BLOCK:,}")
        if use["LOCAL"] or use["STACK"]:
            problems.append(f"{launch}: {use['LOCAL']} B of local memory, a {use['STACK']} B stack (spills)")
    assert target.results and not problems, "\n".join(problems)


def test_fp8_reaches_no_kernel_with_e4m3_so_8_0_refuses_it_for_the_matrix_products_alone(launches, compiled_for):
    """e4m3 is the FP8 format Triton has no code for below 8.9; no launch passes it: --fp8's kernels
    write the gradient's e5m2 codes and the transpose moves them as bytes, and these compile for 8.0
    too. The guard refuses --fp8 on 8.0, and each recipe that sets it, for torch._scaled_mm's e4m3
    products (its line says so), not for a Triton kernel."""
    dtypes = {v.dtype for launch in launches for _, v in launch.named() if torch.is_tensor(v)}
    assert torch.float8_e4m3fn not in dtypes and {torch.float8_e5m2, torch.uint8} <= dtypes
    target = compiled_for(80)
    fp8_only = [(launch, kernel) for launch, kernel in target.results if all(c.fp8 for _, c in launch.configs)]
    assert fp8_only and all(not isinstance(kernel, Exception) for _, kernel in fp8_only)
    recipes = [name for name in tg.RECIPES if tg.make_config(recipe=name).fp8]
    assert set(recipes) >= {"fp8_yarn", *FUSED_RECIPES}
    for name in recipes:
        problems = refusals(tg.make_config(recipe=name), target.gpu)
        assert [(flag, "torch._scaled_mm" in lacks) for flag, lacks, _ in problems] == [("--fp8", True)]
