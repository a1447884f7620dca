"""The GPU guard and what fits where (docs/scale.md), proven on the CPU: the trainer reads a GPU's
name, compute capability and memory at one place, tg.gpu_properties, and every test here fakes it
there. Each feature a GPU lacks (FP8 < 8.9, FA3 off Hopper, bf16 and FlexAttention < 8.0, memory)
is refused in one line naming the flag, what the GPU lacks and the nearest flags that run, before
anything compiles; auto picks what the GPU has and the log says so; the dry run predicts the peak
of each micro-batch setting of every recipe at a GPU count and memory, and says which fit."""
import json
import re
import types
from pathlib import Path

import pytest
import torch

import train_gpt_medium as tg
from test_checkpoint import log_text, run_argv

ROOT = Path(__file__).resolve().parent.parent
GiB, MiB = 2**30, 2**20

# GPU classes as torch reports them (name, compute capability, memory; the memory in round GiB)
GPUS = {
    "A100 80GB": tg.GpuProperties("NVIDIA A100-SXM4-80GB", (8, 0), 80 * GiB),
    "A100 40GB": tg.GpuProperties("NVIDIA A100-SXM4-40GB", (8, 0), 40 * GiB),
    "H100": tg.GpuProperties("NVIDIA H100 80GB HBM3", (9, 0), 80 * GiB),
    "H200": tg.GpuProperties("NVIDIA H200", (9, 0), 141 * GiB),
    "L40S": tg.GpuProperties("NVIDIA L40S", (8, 9), 48 * GiB),
    "RTX 4090": tg.GpuProperties("NVIDIA GeForce RTX 4090", (8, 9), 24 * GiB),
    "RTX 3090": tg.GpuProperties("NVIDIA GeForce RTX 3090", (8, 6), 24 * GiB),
    "T4": tg.GpuProperties("Tesla T4", (7, 5), 15 * GiB),
    "V100": tg.GpuProperties("Tesla V100-SXM2-32GB", (7, 0), 32 * GiB),
}


def verdict(gpu: str, world_size: int, argv=(), memory=None):
    """(config with auto resolved, the auto line, the refusal lines) of `argv` on `world_size` GPUs."""
    return tg.gpu_verdict(tg.parse_args(list(argv)), GPUS[gpu], world_size, memory)


def fix_flags(line: str) -> list[str]:
    """The flags a refusal line offers ("nearest that runs here: ..." or "nearest that fits: ..."), as
    parse_args takes them (`--recipe NAME` as two arguments)."""
    match = re.search(r"nearest that (?:runs here|fits): (.*?)(?: \(predicted .*)?$", line)
    assert match, line
    return match.group(1).split()


def test_the_trainer_reads_a_gpus_properties_at_one_place(monkeypatch):
    """gpu_properties asks torch once; no other line of the trainer asks torch about the device."""
    props = types.SimpleNamespace(name="NVIDIA H100 80GB HBM3", major=9, minor=0, total_memory=85_520_809_984)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    gpu = tg.gpu_properties(torch.device("cuda", 0))
    assert gpu == ("NVIDIA H100 80GB HBM3", (9, 0), 85_520_809_984)
    assert gpu.label == "NVIDIA H100 80GB HBM3, compute capability 9.0, 81,559 MiB"
    source = Path(tg.__file__).read_text()
    asks = [m.start() for m in re.finditer(r"torch\.cuda\.get_device_\w+\(", source)]
    start = source.index("def gpu_properties(")
    assert len(asks) == 1 and start < asks[0] < source.index("\ndef ", start + 1)


# ---- each (feature, GPU class) pair

def test_fp8_on_an_a100_is_refused_naming_the_flag_and_its_recipe_without_it():
    _, _, lines = verdict("A100 80GB", 8, ["--recipe=fp8_yarn"])
    assert lines == ["--fp8: this GPU (NVIDIA A100-SXM4-80GB, compute capability 8.0, 81,920 MiB) lacks FP8 matrix "
                     "products (torch._scaled_mm: compute capability 8.9 or more, Ada or Hopper); nearest that runs "
                     "here: --recipe fp8_yarn --fp8=false"]
    assert verdict("A100 80GB", 8, ["--recipe=fp8_yarn", "--fp8=false"])[2] == []  # the offered flags run


@pytest.mark.parametrize("recipe", ["bigram", "mudd"])
def test_the_fused_fp8_loss_on_an_a100_is_refused_naming_fp8_and_the_fused_loss(recipe):
    _, _, lines = verdict("A100 80GB", 8, [f"--recipe={recipe}"])
    (line,) = lines
    assert line.startswith("--fp8: this GPU (NVIDIA A100-SXM4-80GB") and "--fused_softcap_ce" in line
    assert line.endswith(f"nearest that runs here: --recipe {recipe} --fp8=false")
    assert verdict("A100 80GB", 8, [f"--recipe={recipe}", "--fp8=false"])[2] == []


def test_fp8_needs_compute_capability_8_9_exactly():
    """Ada (8.9) has FP8 products, Ampere's consumer cards (8.6) do not."""
    fp8 = tg.make_config(recipe="fp8_yarn")
    assert tg.gpu_feature_problems(fp8, GPUS["L40S"]) == []
    assert [p[0] for p in tg.gpu_feature_problems(fp8, GPUS["RTX 3090"])] == ["--fp8"]


def test_on_an_h100_every_recipe_runs_on_8_gpus_and_fa3_too(fake_fa3_kernel):
    assert tg.recipes_on_gpu(GPUS["H100"], 8) == {name: [] for name in tg.RECIPES}
    assert verdict("H100", 8, ["--attention=fa3"])[2] == []
    tg.check_fa3_device(torch.device("cuda", 0))  # the same rule, and the kernel is fetched


@pytest.fixture
def fake_fa3_kernel(monkeypatch):
    import sys
    hub = types.SimpleNamespace(flash_attn_interface=types.SimpleNamespace(flash_attn_varlen_func=print))
    module = types.ModuleType("kernels")
    module.get_kernel = lambda name: hub
    monkeypatch.setitem(sys.modules, "kernels", module)
    monkeypatch.setattr(tg.kernels, "_fa3_kernel", {})
    monkeypatch.setattr(tg, "gpu_properties", lambda device: GPUS["H100"])


def test_fa3_on_an_a100_is_refused_naming_flex_by_the_guard_and_by_the_fa3_check(monkeypatch):
    _, _, lines = verdict("A100 80GB", 8, ["--attention=fa3"])
    assert lines == ["--attention=fa3: this GPU (NVIDIA A100-SXM4-80GB, compute capability 8.0, 81,920 MiB) lacks "
                     "FlashAttention-3's kernels, built for Hopper only (compute capability 9.x); nearest that runs "
                     "here: --attention=flex"]
    monkeypatch.setattr(tg, "gpu_properties", lambda device: GPUS["A100 80GB"])
    with pytest.raises(tg.ConfigError, match=r"^--attention: fa3 runs on Hopper GPUs \(compute capability 9.x\); "
                                             r"this GPU \(NVIDIA A100-SXM4-80GB\) is 8.0: use --attention=flex$"):
        tg.check_fa3_device(torch.device("cuda", 0))


def test_bf16_on_a_t4_is_refused_naming_float32_where_the_model_is_small():
    _, _, lines = verdict("T4", 1, ["--preset=tiny", "--dtype=bfloat16"])
    assert lines == ["--dtype=bfloat16: this GPU (Tesla T4, compute capability 7.5, 15,360 MiB) lacks bf16 matrix "
                     "units and Triton's bf16 kernels (compute capability 8.0 or more); nearest that runs here: "
                     "--dtype=float32"]
    assert verdict("T4", 1, ["--preset=tiny", "--dtype=float32"])[2] == []


def test_bf16_on_a_t4_at_the_records_size_says_that_nothing_of_that_size_runs_there():
    """Its fallback, float32 and sdpa, builds dense (T, T) masks: at least 10 bytes a pair of the
    262,144-token validation slice, 640 GiB."""
    _, _, (line,) = verdict("T4", 1, ["--dtype=bfloat16"])
    assert line.startswith("--dtype=bfloat16: this GPU (Tesla T4, compute capability 7.5, 15,360 MiB) lacks bf16")
    assert "nothing of this size runs on this GPU: sdpa's dense masks of slices this long do not fit" in line
    assert "slices of at most 40,132 tokens, training's and validation's, would have masks that fit" in line
    assert tg.dense_mask_bytes(tg.make_config()) == 10 * 262_144**2 == 640 * GiB
    assert 10 * 40_132**2 <= 15 * GiB < 10 * 40_133**2


def test_the_record_cut_into_slices_whose_masks_fit_is_let_through_a_t4_unpredicted():
    """64 slices of 8,192 tokens, validation's of 32,768: 10 GiB of masks. A float32 run's peak is
    not predicted, so the guard holds nothing else against it."""
    config, _, lines = verdict("T4", 1, ["--batch_slices=64", "--train_seq_len=8192", "--val_seq_len=32768"])
    assert lines == [] and (config.dtype, config.attention) == ("float32", "sdpa")
    assert tg.predicted_peak_mib(config, 1) is None


def test_the_record_on_a_t4_with_every_switch_on_auto_is_refused_for_sdpas_masks():
    _, auto, (line,) = verdict("T4", 1)
    assert "--dtype=auto -> float32" in auto and "--attention=auto -> sdpa" in auto
    assert line.startswith("--attention=sdpa (auto's choice below 8.0): this GPU (Tesla T4, compute capability 7.5, "
                           "15,360 MiB) lacks the memory for sdpa's dense (T, T) masks (at least 655,360 MiB")
    assert "nothing of this size runs on this GPU" in line


def test_flex_on_a_v100_is_refused_naming_sdpa():
    _, _, lines = verdict("V100", 1, ["--preset=tiny", "--attention=flex"])
    assert lines == ["--attention=flex: this GPU (Tesla V100-SXM2-32GB, compute capability 7.0, 32,768 MiB) lacks "
                     "FlexAttention's Triton kernels (compute capability 8.0 or more; run eagerly it would ignore the "
                     "window); nearest that runs here: --attention=sdpa"]


def test_sdpa_at_the_records_size_on_an_a100_is_refused_naming_flex():
    _, _, (line,) = verdict("A100 80GB", 8, ["--attention=sdpa"])
    assert line.startswith("--attention=sdpa: this GPU (NVIDIA A100-SXM4-80GB") and "dense (T, T) masks" in line
    assert line.endswith("nearest that runs here: --attention=flex")


def test_the_record_on_a_24_gb_card_is_refused_with_the_nearest_micro_batch_that_fits():
    """The line names the predicted peak and the first setting of micro_batch_settings (the same
    training first) whose prediction fits; the settings before it do not."""
    _, _, (line,) = verdict("RTX 4090", 1)
    peak = tg.predicted_peak_mib(tg.make_config(), 1)
    assert line.startswith(f"memory (--batch_slices=8 --train_seq_len=65536 --val_seq_len=262144): the predicted peak "
                           f"{peak:,} MiB per GPU on 1 GPU is more than this GPU's 24,576 MiB (NVIDIA GeForce RTX 4090)")
    flags = fix_flags(line)
    fixed = tg.parse_args(flags)
    assert tg.predicted_peak_mib(fixed, 1) * MiB <= 24 * GiB and verdict("RTX 4090", 1, flags)[2] == []
    settings = tg.micro_batch_settings(tg.make_config())
    first = next(i for i, s in enumerate(settings) if all(getattr(fixed, k) == v for k, v in s.items()))
    for earlier in settings[:first]:
        assert tg.predicted_peak_mib(tg.make_config(**earlier), 1) * MiB > 24 * GiB, earlier
    assert "this changes training" in line and "--gpu_memory_gib" in line


def test_a_feature_and_the_memory_refused_together_offer_one_command_that_runs():
    """mudd on one A100 of 40 GB: FP8 is missing and its peak is too large; each line offers the
    same flags, which run there."""
    _, _, lines = verdict("A100 40GB", 1, ["--recipe=mudd"])
    assert [line.split(":")[0] for line in lines] == ["--fp8", "memory (--batch_slices=8 --train_seq_len=65536 "
                                                      "--val_seq_len=262144)"]
    assert fix_flags(lines[0]) == fix_flags(lines[1])
    assert verdict("A100 40GB", 1, fix_flags(lines[0]))[2] == []


def test_one_gpu_of_80_or_141_gb_runs_the_record_by_accumulation():
    assert verdict("H100", 1)[2] == [] and verdict("H200", 1)[2] == []
    assert tg.recipes_on_gpu(GPUS["H200"], 1) == {name: [] for name in tg.RECIPES}


def test_gpu_memory_gib_replaces_the_gpus_memory_in_the_check():
    """More memory than the GPU reports runs what the estimate refuses; less refuses what would fit."""
    assert verdict("RTX 4090", 1, memory=80 * GiB)[2] == []
    (line,) = verdict("H100", 8, memory=40 * GiB)[2]
    assert "is more than the 40,960 MiB of --gpu_memory_gib" in line


# ---- auto

def test_auto_picks_bf16_and_flex_from_8_0_and_keeps_the_config():
    config, auto, lines = verdict("A100 80GB", 8)
    assert auto == ("auto on this GPU (NVIDIA A100-SXM4-80GB, compute capability 8.0, 81,920 MiB): --dtype=auto -> "
                    "bfloat16, --attention=auto -> flex")
    assert config == tg.make_config() and lines == []


def test_auto_picks_float32_and_sdpa_below_8_0_and_sets_them_in_the_config():
    config, auto, lines = verdict("T4", 1, ["--preset=tiny"])
    assert (config.dtype, config.attention, lines) == ("float32", "sdpa", [])
    assert auto == ("auto on this GPU (Tesla T4, compute capability 7.5, 15,360 MiB): --dtype=auto -> float32 (bf16 "
                    "needs compute capability 8.0 or more), --attention=auto -> sdpa (FlexAttention needs compute "
                    "capability 8.0 or more)")
    assert verdict("T4", 1, ["--preset=tiny", "--dtype=float32", "--attention=sdpa"])[1] is None  # nothing on auto


# ---- in a run: before anything is built, on the GPU's own properties

class Built(Exception):
    pass


@pytest.fixture
def fake_cuda_run(monkeypatch):
    """run_training as on a GPU up to the Runner, which raises Built: the device is CUDA, set_device a
    no-op, the GPU's properties whatever the test sets (tg.gpu_properties)."""
    monkeypatch.setattr(tg, "resolve_device", lambda config, local_rank: torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    for name in tg.ALLOC_CONF_VARIABLES:
        monkeypatch.setenv(name, "")

    def runner(*args, **kwargs):
        raise Built
    monkeypatch.setattr(tg, "Runner", runner)
    return lambda gpu: monkeypatch.setattr(tg, "gpu_properties", lambda device: GPUS[gpu])


def test_a_run_refused_by_the_guard_exits_2_with_its_line_and_writes_nothing(fake_cuda_run, synthetic_dir, tmp_path,
                                                                           capsys):
    fake_cuda_run("A100 80GB")
    argv = [a for a in run_argv(synthetic_dir, tmp_path) if a != "--device=cpu"] + ["--fp8"]
    assert tg.main(argv) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: --fp8: this GPU (NVIDIA A100-SXM4-80GB") and line.endswith("--fp8=false")
    assert not (tmp_path / "logs").exists()


def test_the_record_on_one_24_gb_card_is_refused_before_its_data_is_read(fake_cuda_run, tmp_path, capsys):
    """The guard comes before the data checks: no shards are needed to learn that it does not fit."""
    fake_cuda_run("RTX 4090")
    assert tg.main([f"--log_dir={tmp_path / 'logs'}", f"--train_files={tmp_path / 'none_*.bin'}"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: memory (--batch_slices=8 --train_seq_len=65536 --val_seq_len=262144): the "
                           "predicted peak") and "nearest that fits: --batch_slices=16" in line
    assert not (tmp_path / "logs").exists()


def test_a_run_on_a_t4_logs_what_auto_picked_and_runs_float32_and_sdpa(fake_cuda_run, synthetic_dir, tmp_path):
    fake_cuda_run("T4")
    with pytest.raises(Built):
        tg.main([a for a in run_argv(synthetic_dir, tmp_path) if a != "--device=cpu"])
    text = log_text(tmp_path)
    assert "auto on this GPU (Tesla T4, compute capability 7.5, 15,360 MiB): --dtype=auto -> float32" in text
    assert "dtype = 'float32'" in text and "attention = 'sdpa'" in text


# ---- what fits where: the peak model at other world sizes and micro-batches

def record_activations() -> int:
    """The record's logged peak less what it held per GPU: its DistAdam's moments, 1/8 of each
    tensor of 1,024 elements or more and the smaller ones whole (the record's rule, written here)."""
    config = tg.make_config()
    with torch.device("meta"):
        model = tg.GPT(config, torch.bfloat16)
    held = tg.state_bytes_per_gpu(model, config, 8)
    assert held["adam"] == sum(tg.optimizer_state_bytes(n, p, config) // (8 if p.numel() >= 1024 else 1)
                               for n, ps in tg.parameter_groups(model).items() if not n.startswith("muon") for p in ps)
    return tg.RECIPES["bulk"].peak_mib * MiB - sum(held.values())


def test_one_gpu_holds_all_of_muons_and_adams_state_and_the_same_activations():
    config = tg.make_config()
    with torch.device("meta"):
        model = tg.GPT(config, torch.bfloat16)
    muon_total = sum(tg.muon_owned_bytes(model, config, 1))
    adam_total = tg.adam_bytes_per_rank(model, config, 1)
    one, eight = tg.peak_parts(config, 1), tg.peak_parts(config, 8)
    assert one["state"] - eight["state"] == (muon_total - max(tg.muon_owned_bytes(model, config, 8))
                                             + adam_total - tg.adam_bytes_per_rank(model, config, 8))
    assert adam_total == 8 * tg.adam_bytes_per_rank(model, config, 8) - 7 * sum(
        tg.optimizer_state_bytes(n, p, config) for n, ps in tg.parameter_groups(model).items()
        if not n.startswith("muon") for p in ps if p.numel() < 1024)  # the small tensors: whole on each
    assert (one["training"], one["evaluation"]) == (eight["training"], eight["evaluation"])
    assert one["training"] == record_activations()


def test_a_shorter_slice_scales_the_records_activations_with_its_tokens():
    half = tg.make_config(batch_slices=16, train_seq_len=32768, val_seq_len=131072)
    assert tg.peak_parts(half, 8)["training"] == round(record_activations() / 2)


def test_checkpointing_keeps_the_blocks_inputs_one_block_and_one_loss_chunk():
    """16 outputs + 3 skip sums + 2 x 2 embeddings + 5 value embeddings = 28 (T, d) bf16 tensors,
    one block's share of the record's activations less its logits, two chunks of bf16 logits."""
    T, d, V = 65536, 1024, 50304
    parts = tg.peak_parts(tg.make_config(activation_checkpointing=True), 8)
    one_block = (record_activations() - T * V * 2) / 16
    assert parts["training"] == round(28 * T * d * 2 + one_block + 2 * 2 * 8192 * V)
    assert parts["training"] < tg.peak_parts(tg.make_config(), 8)["training"]


def test_the_peak_is_the_state_and_the_larger_of_training_and_validation():
    """With checkpointing at the record's slices validation's 262,144-token slice is the larger."""
    config = tg.make_config(activation_checkpointing=True)
    parts = tg.peak_parts(config, 1)
    assert parts["evaluation"] > parts["training"]
    T_val, d, V = 262144, 1024, 50304
    assert parts["evaluation"] == 28 * T_val * d * 2 + T_val // 4 * V * 6 + T_val * 4 * d * 2
    logged = tg.RECIPES["bulk"].peak_mib
    assert tg.predicted_peak_mib(config, 1) == logged + round((parts["state"] + parts["evaluation"] - logged * MiB) / MiB)


def test_the_micro_batch_settings_keep_the_steps_tokens_and_pass_the_config_check():
    settings = tg.micro_batch_settings(tg.make_config())
    assert [(s["batch_slices"], s["activation_checkpointing"]) for s in settings] == [
        (k, c) for k in (8, 16, 32, 64) for c in (False, True)]
    for s in settings:
        config = tg.make_config(**s)
        assert config.batch_slices * config.train_seq_len == 8 * 65536
        assert config.val_tokens % (config.batch_slices * config.val_seq_len) == 0


def test_no_peak_is_predicted_where_the_world_size_does_not_divide_the_slices():
    assert tg.predicted_peak_mib(tg.make_config(), 3) is None


# ---- the dry run's table of what fits

FIT_ROW = re.compile(r"^  (\w+)\s+([\d,]+) MiB  (fits|does not fit)\s+(.*)$")


def fit_rows(out: str) -> list[tuple[str, int, str, str]]:
    return [(m[1], int(m[2].replace(",", "")), m[3], m[4]) for m in map(FIT_ROW.match, out.splitlines()) if m]


def setting_argv(recipe: str, setting: str) -> list[str]:
    flags = [] if setting.startswith("its own micro-batch") else setting.replace(" (changes training)", "").split()
    return [f"--recipe={recipe}", *flags]


def test_the_dry_run_names_what_fits_on_one_24_gb_gpu_for_every_recipe(capsys):
    """Every recipe's eight settings, each word as its own prediction at 1 GPU against 24 GiB says."""
    assert tg.main(["--dry_run", "--gpu_memory_gib=24", "--gpu_count=1"]) == 0
    out = capsys.readouterr().out
    assert "what fits on 1 GPU of 24 GiB (24,576 MiB) each" in out
    rows = fit_rows(out)
    assert [r[0] for r in rows] == [name for name in [*tg.RECIPES, *tg.CANDIDATES] for _ in range(8)]
    for recipe, peak, word, setting in rows:
        expected = tg.predicted_peak_mib(tg.parse_args(setting_argv(recipe, setting)), 1)
        assert peak == expected and word == ("fits" if expected * MiB <= 24 * GiB else "does not fit"), setting
    assert {r[2] for r in rows} == {"fits", "does not fit"}
    own = next(line for line in out.splitlines() if line.startswith("  this configuration:"))
    assert own == f"  this configuration: {rows[0][1]:,} MiB, does not fit"
    assert "  this configuration's nearest that fits: --batch_slices=16" in out


def test_the_dry_run_plans_for_the_records_8_gpus_of_80_gb_unless_told(capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert tg.main(["--dry_run"]) == 0
    out = capsys.readouterr().out
    assert "what fits on 8 GPUs of 80 GiB (81,920 MiB) each" in out
    assert fit_rows(out)[0][:3] == ("bulk", tg.predicted_peak_mib(tg.make_config()), "fits")
    monkeypatch.setenv("WORLD_SIZE", "2")  # under torchrun: its world size
    assert tg.main(["--dry_run"]) == 0
    assert "what fits on 2 GPUs of 80 GiB" in capsys.readouterr().out


def test_gpu_count_without_the_dry_run_is_noted_as_having_no_effect():
    assert "note: --gpu_count=1 has no effect without --dry_run" in tg.recipe_notes(tg.make_config(gpu_count=1))


# ---- tools/gpu_check.sh: the GPU class row

def test_gpu_check_probes_the_gpu_class_and_which_recipes_run_on_it(monkeypatch, capsys):
    import sys
    sys.path.insert(0, str(ROOT / "tools"))
    import gpu_check
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(tg, "gpu_properties", lambda device: GPUS["A100 80GB"])
    monkeypatch.setattr(tg, "importable", lambda name: name == "triton")
    report = gpu_check.machine_probe([])
    assert report["gpu"]["gpus"] == 8 and report["gpu"]["this_run"] == []
    assert report["gpu"]["recipes"] == tg.recipes_on_gpu(GPUS["A100 80GB"], 8)
    row = gpu_check.gpu_class_row(json.loads(json.dumps(report)))
    assert row["ok"] and row["measured"] == ("NVIDIA A100-SXM4-80GB, compute capability 8.0, 81,920 MiB, 8 GPU(s): "
                                             "runs bulk; not fp8_yarn (--fp8); not bigram (--fp8); not mudd (--fp8)")
    printed = capsys.readouterr().out
    assert "[gpu_check] recipe fp8_yarn on 8 GPU(s) like this one: --fp8: this GPU" in printed
    refused = gpu_check.gpu_class_row(dict(report, gpu=dict(report["gpu"], this_run=["--fp8: ..."])))
    assert not refused["ok"] and refused["reason"] == "GPU class: the GPU guard refuses the runs' flags: --fp8: ..."
