"""tools/gpu_check.sh --offline --arch CC (tools/offline_compile.py): the training step compiled for a GPU
this machine does not have. Here on the CPU: the arch's names, each bad input refused in one line with
exit code 2 before anything is built or written (an unknown arch, a CPU build of torch, no C compiler,
a recipe the arch's GPU guard refuses), and the table's rows from a compile's report. The compile
itself needs torch's CUDA build: the slow test at the end runs it under the GPU stack's interpreter
(tools/test_gpu_stack.sh) and is skipped elsewhere."""
import json
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import torch._dynamo  # noqa: F401  (its import makes torch's cache folder: here, before a test's temporary folder)

import train_gpt_medium as tg

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import gpu_check  # noqa: E402
from tools import offline_compile as offline  # noqa: E402

A100 = tg.GpuProperties("NVIDIA A100-SXM4-80GB", (8, 0), 80 * 2**30)
L4 = tg.GpuProperties("NVIDIA L4", (8, 9), 24 * 2**30)


@pytest.mark.parametrize("text, capability", [("9.0", (9, 0)), ("sm_90", (9, 0)), ("sm89", (8, 9)),
                                              ("8.0", (8, 0)), ("sm_100", (10, 0))])
def test_an_arch_is_major_dot_minor_or_an_sm_name(text, capability):
    assert offline.parse_arch(text) == capability


@pytest.mark.parametrize("text, says", [("nine", "is not a compute capability"), ("9", "is not a compute capability"),
                                        ("9.0.1", "is not a compute capability"), ("sm_9x", "not a compute capability"),
                                        ("9.1", "9.1 is not in the table"), ("sm_72", "7.2 is not in the table"),
                                        (None, "needs the compute capability")])
def test_a_malformed_or_unknown_arch_is_refused_naming_the_known_ones(text, says):
    with pytest.raises(tg.ConfigError) as refused:
        offline.parse_arch(text)
    assert str(refused.value).startswith("--arch: ") and says in str(refused.value)
    assert "9.0 (NVIDIA H100 80GB HBM3)" in str(refused.value)


@pytest.fixture
def nothing_started(tmp_path, monkeypatch):
    """Temporary files go to tmp_path (the check's folder would be made there) and no compile starts:
    the list of started runs."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    started = []
    monkeypatch.setattr(gpu_check, "run_trainer", lambda *args, **kwargs: started.append(args))
    return started


def refused(capsys, tmp_path, started, *flags) -> str:
    """gpu_check --offline with `flags`: exit code 2, nothing started or written; its one stderr line."""
    assert gpu_check.main(["--offline", *flags]) == 2
    out, err = capsys.readouterr()
    assert started == [] and list(tmp_path.iterdir()) == [] and out == ""
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
    return err.strip()


@pytest.mark.parametrize("flags", [["--arch", "9.9"], ["--arch=sm_x"], []])
def test_offline_with_a_bad_arch_exits_2_in_one_line(flags, nothing_started, tmp_path, capsys):
    assert refused(capsys, tmp_path, nothing_started, *flags).startswith("error: --arch: ")


def test_arch_without_offline_is_refused(nothing_started, tmp_path, capsys):
    assert gpu_check.main(["--arch", "9.0"]) == 2
    assert "with --offline" in capsys.readouterr().err


def test_offline_with_a_cpu_build_of_torch_says_what_to_install(nothing_started, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.version, "cuda", None)
    line = refused(capsys, tmp_path, nothing_started, "--arch", "9.0", "--preset", "tiny")
    assert "is a CPU build" in line and "pip install -r requirements-gpu-stack.txt" in line
    assert "PYTHON=.venv-gpu-stack/bin/python tools/gpu_check.sh --offline" in line


def test_offline_without_a_c_compiler_says_so(nothing_started, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CC", "no-such-c-compiler")
    line = refused(capsys, tmp_path, nothing_started, "--arch", "9.0", "--preset", "tiny")
    assert "no C compiler" in line and "CC" in line


@pytest.mark.parametrize("arch, gpu, recipe, says", [("8.0", A100, "fp8_yarn", "--fp8: "),
                                                     ("8.9", L4, "mudd", "nearest that fits: --recipe mudd ")])
def test_a_recipe_the_arch_cannot_run_gets_the_guards_line(arch, gpu, recipe, says, nothing_started, tmp_path,
                                                           monkeypatch, capsys):
    """The guard runs first, with the arch's usual card: its lines (the trainer's own, on the record's 8
    GPUs) and nothing compiled, whatever the machine has (here a CPU build of torch: not reached)."""
    monkeypatch.setattr(torch.version, "cuda", None)
    line = refused(capsys, tmp_path, nothing_started, "--arch", arch, "--recipe", recipe)
    guard = tg.gpu_verdict(tg.make_config(recipe=recipe), gpu, 8)[2]
    assert line == "error: " + "\n".join(guard) and says in line


def test_the_child_writes_its_caches_and_temporary_files_inside_the_checks_folder(tmp_path, monkeypatch):
    """Inductor's and Triton's caches and the temporary files of a compile (ptxas's) go to the check's
    own folder; the shim comes first in the preload and the library path, the arch's card in the
    OFFLINE_GPU_* variables the shim reads."""
    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/other.so")
    env = offline.child_environment((8, 9), tmp_path / "mudd", tmp_path / "libcuda.so.1")
    for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "TRITON_HOME", "TMPDIR"):
        assert Path(env[name]).is_dir() and Path(env[name]).is_relative_to(tmp_path / "mudd"), name
    assert env["LD_PRELOAD"] == f"{tmp_path / 'libcuda.so.1'} /usr/lib/other.so"
    assert env["LD_LIBRARY_PATH"].split(":")[0] == str(tmp_path)
    assert (env["OFFLINE_GPU_MAJOR"], env["OFFLINE_GPU_MINOR"], env["OFFLINE_GPU_SHARED_PER_BLOCK"]) == ("8", "9", "101376")
    assert int(env["OFFLINE_GPU_MEMORY"]) == 24 * 2**30 and env["OFFLINE_GPU_NAME"] == "NVIDIA L4"


def report(**changes) -> dict:
    """A child's report of a clean compile (tools/offline_compile.py compile_step), with `changes`."""
    clean = dict(graphs=12, recompiles=6, graph_breaks=0, break_reasons=[], seconds={"step 0": 100}, error=None,
                 kernels=131, binaries=300, shared_limit=232_448, over_limits=[], configs_over_limits=0,
                 spill_threshold_bytes=64, spills=[], spills_within_threshold=[], spilling_configs=0,
                 largest_shared=dict(bytes=132_096, kernel="triton_tem_fused_0"),
                 largest_registers=dict(registers=255, kernel="triton_tem_fused_1", num_warps=8))
    return clean | changes


def compile_offline(monkeypatch, capsys, reports: dict, *flags) -> tuple[int, dict, list]:
    """gpu_check --offline with the environment taken as ready and each recipe's compile answered by
    `reports` (recipe -> the child's report): (exit code, the summary JSON, the recipes compiled)."""
    monkeypatch.setattr(offline, "environment_problem", lambda: None)
    monkeypatch.setattr(offline, "build_shim", lambda folder: folder / "libcuda.so.1")
    monkeypatch.setattr(offline, "child_environment", lambda *args: {})
    compiled = []

    def run(name, flags, processes, limit, script, environment):
        recipe = tg.parse_args(flags[1:]).recipe
        compiled.append(recipe)
        return gpu_check.Run(name, 0, json.dumps(reports[recipe]), 1.0)

    monkeypatch.setattr(gpu_check, "run_trainer", run)
    code = gpu_check.main(["--offline", *flags])
    return code, json.loads(capsys.readouterr().out.strip().splitlines()[-1]), compiled


def test_recipe_all_gives_a_row_per_recipe_and_compiles_what_the_guard_admits(monkeypatch, capsys):
    """On an A100 (8.0) the recipes with FP8 are refused by the guard (a row each, not compiled, not a
    failure); bulk compiles."""
    code, summary, compiled = compile_offline(monkeypatch, capsys, {"bulk": report()}, "--arch", "8.0",
                                              "--recipe", "all")
    assert code == 0 and summary["ok"] and summary["arch"] == "8.0" and compiled == ["bulk"]
    guard = {c["check"].removeprefix("GPU guard, "): c["measured"] for c in summary["checks"]
             if c["check"].startswith("GPU guard, ")}
    assert list(guard) == list(tg.RECIPES)
    assert guard["bulk"].startswith("runs on 8 GPUs like NVIDIA A100-SXM4-80GB")
    assert all(guard[name].startswith("refused: --fp8: ") for name in ("fp8_yarn", "bigram", "mudd"))
    compile_row = next(c for c in summary["checks"] if c["check"] == "compile, bulk")
    assert "131 Triton kernels (300 binaries)" in compile_row["measured"] and "0 graph breaks" in compile_row["measured"]


def test_recipe_all_fails_when_the_guard_refuses_every_recipe(monkeypatch, capsys):
    """On a 24 GiB card (8.9) the record's size is refused on memory for every recipe: nothing compiles,
    each row names the setting that fits, and the verdict is a failure, not an empty success."""
    code, summary, compiled = compile_offline(monkeypatch, capsys, {}, "--arch", "8.9", "--recipe", "all")
    assert code == 1 and not summary["ok"] and compiled == []
    *recipes, verdict = summary["checks"]
    assert [c["check"] for c in recipes] == [f"GPU guard, {name}" for name in tg.RECIPES]
    assert all(c["ok"] and "nearest that fits: " in c["measured"] for c in recipes)
    assert not verdict["ok"] and verdict["reason"].startswith("the GPU guard refuses every recipe on NVIDIA L4")


@pytest.mark.parametrize("changes, failed, says", [
    (dict(error=dict(phase="step 0", error="ValueError: Q and KV block size", flag="--attention=sdpa")),
     "compile, bulk", "step 0: ValueError: Q and KV block size (avoid it: --attention=sdpa)"),
    (dict(graph_breaks=5, break_reasons=["Unsupported: triton.knobs"]), "compile, bulk", "5 graph break(s)"),
    (dict(over_limits=[dict(kernel="triton_tem_fused_7", shared=240_000, registers=200, num_warps=8)]),
     "shared memory, bulk", "triton_tem_fused_7 needs 240,000 B in its smallest config"),
    (dict(over_limits=[dict(kernel="triton_red_fused_3", shared=0, registers=255, num_warps=16)]),
     "registers, bulk", "triton_red_fused_3 uses 255 per thread at 16 warps"),
    (dict(spills=[["triton_per_fused_2", 96, 120, 80]], spilling_configs=3), "spills, bulk",
     "every config of 1 kernel(s) spills past inductor's threshold of 64 B per thread: triton_per_fused_2 96 B frame, "
     "120 B spilled (80 B reloaded)"),
])
def test_a_compile_error_a_break_or_a_kernel_over_the_arch_limits_fails_its_row(changes, failed, says, monkeypatch,
                                                                               capsys):
    code, summary, _ = compile_offline(monkeypatch, capsys, {"bulk": report(**changes)}, "--arch", "9.0")
    failures = {c["check"]: c["reason"] for c in summary["checks"] if not c["ok"]}
    assert code == 1 and list(failures) == [failed] and says in failures[failed]


def test_spills_within_inductors_threshold_are_reported_not_failed(monkeypatch, capsys):
    """FlexAttention's backward at the record's size on sm_90 keeps a 40 B frame with 68 B of spill
    stores in every config (ptxas -v, offline and on an H200): inductor's autotuning keeps such a
    config (it skips those over 16 registers, 64 B), so the row names it and passes."""
    flex = ["triton_tem_fused_flex_attention_backward_10", 40, 68, 44]
    code, summary, _ = compile_offline(monkeypatch, capsys, {"bulk": report(spills_within_threshold=[flex])},
                                       "--arch", "9.0")
    (spills,) = [c for c in summary["checks"] if c["check"] == "spills, bulk"]
    assert code == 0 and spills["ok"]
    assert spills["measured"] == ("within the threshold, every config of 1 kernel(s): "
                                  "triton_tem_fused_flex_attention_backward_10 40 B frame, 68 B spilled (44 B reloaded)")


def spilling_kernel_binaries():
    """One Triton kernel (a (64, 64) fp32 tile held across a row maximum, one warp: 168 registers)
    compiled for sm_90 as it is, and again held to 32 registers (`maxnreg`), which makes ptxas
    spill: {None: binary, 32: binary}."""
    triton = pytest.importorskip("triton")
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    @triton.jit
    def rows_minus_max(x_ptr, y_ptr, BLOCK: tl.constexpr):
        offsets = tl.arange(0, BLOCK)[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
        x = tl.load(x_ptr + offsets)
        tl.store(y_ptr + offsets, x - tl.max(x, axis=1)[:, None])

    source = ASTSource(rows_minus_max, signature={"x_ptr": "*fp32", "y_ptr": "*fp32", "BLOCK": "constexpr"},
                       constexprs={"BLOCK": 64})
    return {cap: triton.compile(source, target=GPUTarget("cuda", 90, 32),
                                options=dict(num_warps=1) | ({"maxnreg": cap} if cap else {})) for cap in (None, 32)}


def test_ptxas_tells_a_spill_from_no_spill(tmp_path):
    """What the inventory reads for a kernel with local memory: ptxas -v on its PTX. The same kernel
    with its registers capped spills into a stack frame (the cubin's STACK says so too); uncapped it
    neither spills nor has a frame."""
    binaries = spilling_kernel_binaries()
    free = offline.ptxas_spills(binaries[None].asm["ptx"], (9, 0), tmp_path)
    capped = offline.ptxas_spills(binaries[32].asm["ptx"], (9, 0), tmp_path)
    assert free == dict(stack=0, spill_stores=0, spill_loads=0)
    assert capped["spill_stores"] > 0 and capped["spill_loads"] > 0 and capped["stack"] > 0
    assert offline.resource_usage(binaries[32].asm["cubin"], tmp_path)["STACK"] >= capped["stack"]
    assert offline.resource_usage(binaries[None].asm["cubin"], tmp_path)["STACK"] == 0


def test_the_inventory_counts_a_kernel_only_when_every_config_spills(tmp_path):
    """A kernel one of whose configs spills is fine (inductor can pick the other); one whose only
    config spills its hundreds of bytes is over inductor's threshold (16 registers, 64 B), with
    ptxas's figures beside the frame."""
    binaries = spilling_kernel_binaries()
    compiled = offline.Compiled()
    compiled.kernels = [("uncapped", [binaries[None]]), ("capped", [binaries[32]]),
                        ("either", [binaries[32], binaries[None]])]
    found = offline.inventory(compiled, (9, 0), tmp_path)
    spilled = offline.ptxas_spills(binaries[32].asm["ptx"], (9, 0), tmp_path)
    (name, frame, stores, loads), = found["spills"]
    assert found["spill_threshold_bytes"] == 64 and found["spills_within_threshold"] == []
    assert name == "capped" and frame > 64 and (stores, loads) == (spilled["spill_stores"], spilled["spill_loads"])
    assert found["spilling_configs"] == 2 and found["binaries"] == 4


def test_an_error_in_the_attention_is_avoided_by_sdpa():
    """The flag that avoids an error comes from the trainer's innermost frame it passed through, also
    when the error was raised again from another (dynamo wraps the compiler's)."""
    q = torch.zeros(1, 4, 1, 8)
    with pytest.raises(TypeError) as raised:
        tg.attend(q, q, q, mask=object(), scale=1.0)
    assert offline.avoiding_flag(raised.value) == "--attention=sdpa"
    try:
        raise RuntimeError("backend='inductor' raised") from raised.value
    except RuntimeError as wrapped:
        assert offline.avoiding_flag(wrapped) == "--attention=sdpa"
    assert offline.avoiding_flag(ValueError("elsewhere")) is None


@pytest.mark.slow
@pytest.mark.skipif(torch.version.cuda is None, reason="needs torch's CUDA build (tools/test_gpu_stack.sh runs it)")
def test_the_tiny_preset_compiles_for_sm_90(capsys):
    """The whole path: the shim built, the step 0, last step and evaluation graphs compiled for an H100
    on fake tensors, every Triton kernel a cubin within sm_90's limits, no graph break."""
    code = gpu_check.main(["--offline", "--arch", "9.0", "--preset", "tiny"])
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0, [c["reason"] for c in summary["checks"] if not c["ok"]]
    tiny = summary["compiles"]["bulk"]
    assert tiny["error"] is None and tiny["graph_breaks"] == 0 and tiny["kernels"] > 0
    assert 0 < tiny["largest_shared"]["bytes"] <= 232_448 and tiny["largest_registers"]["registers"] <= 255
