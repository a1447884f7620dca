"""--attn_gate_layers, --mudd_gate and --dc_layers (PR #315, docs/short-track-transfer.md section 5): the
output gates on chosen blocks only, the two gate nets against float64 token loops and their layout, the
neutral start as the plain model bit for bit, DC's band form against a float64 loop and its gradients,
the optimizer group, and the refusals."""
import json

import pytest
import torch

import train_gpt_medium as tg
from test_bulk_model import fill_random, packed

WINDOW = torch.tensor([3, 1])


def tiny(recipe="bulk", **overrides):
    return tg.make_config("tiny", recipe=recipe, **{"dtype": "float32", **overrides})


def loss_and_grads(model, config, window=WINDOW):
    inputs, targets = packed(config)
    model.train()
    model.zero_grad(set_to_none=True)
    loss = model(inputs, targets, window)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def gate_weights(model):
    return {n for n, _ in model.named_parameters() if n.endswith("attn.output_gate.weight")}


def dry_run(capsys, *flags):
    assert tg.main(["--dry_run", *flags]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


# ---- §18 --attn_gate_layers


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_auto_gate_layers_are_the_record_bit_for_bit(dtype):
    plain, chosen = tiny(dtype=dtype), tiny(dtype=dtype, attn_gate_layers=tuple(range(16)))
    assert plain.attn_gate_layers is None and plain.gated_layers == list(range(16))
    models = [tg.build_model(c) for c in (plain, chosen)]
    for model in models:
        fill_random(model)
    (loss_a, grads_a), (loss_b, grads_b) = (loss_and_grads(m, plain) for m in models)
    assert torch.equal(loss_a, loss_b) and grads_a.keys() == grads_b.keys()
    assert all(torch.equal(grads_a[n], grads_b[n]) for n in grads_a)
    assert len(gate_weights(models[0])) == 16


def test_an_empty_list_removes_every_output_gate_and_exactly_their_weights():
    plain, none = tg.build_model(tiny()), tg.build_model(tiny(attn_gate_layers=()))
    count = lambda m: sum(p.numel() for p in m.parameters())
    assert not gate_weights(none) and all(b.attn.output_gate is None for b in none.blocks)
    config = tiny()
    assert count(plain) - count(none) == 16 * config.num_heads * tg.GATE_INPUTS


def test_listed_blocks_keep_their_gates_and_the_others_are_ungated():
    config = tiny(attn_gate_layers=(4, 0, 11, 15))
    model = tg.build_model(config)
    assert config.gated_layers == [0, 4, 11, 15]
    assert gate_weights(model) == {f"blocks.{i}.attn.output_gate.weight" for i in (0, 4, 11, 15)}
    # an ungated block's attention output: the plain attention with the gate taken out by hand
    fill_random(model)
    plain = tg.build_model(tiny())
    fill_random(plain)
    with torch.no_grad():
        for block in plain.blocks:
            block.attn.output_gate.weight.zero_()  # sigmoid(0) = 1/2 everywhere
            block.attn.qkvo_w[3].mul_(2)  # undoes the 1/2 on the blocks that lost the gate
        for i in (0, 4, 11, 15):
            plain.blocks[i].attn.output_gate.weight.copy_(model.blocks[i].attn.output_gate.weight)
            plain.blocks[i].attn.qkvo_w[3].copy_(model.blocks[i].attn.qkvo_w[3])
        inputs, targets = packed(config)
        a = model.eval()(inputs, targets, WINDOW)
        b = plain.eval()(inputs, targets, WINDOW)
    assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def test_the_mudd_recipes_dry_run_drops_the_gates_of_the_unlisted_blocks(capsys):
    plain = dry_run(capsys, "--recipe=mudd")
    gated = dry_run(capsys, "--recipe=mudd", "--attn_gate_layers=0,4,11,15")
    assert plain["total_params"] - gated["total_params"] == 12 * 8 * 16


@pytest.mark.parametrize("flags,words", [
    (["--attn_gate_layers=16"], "--attn_gate_layers: block 16 does not exist"),
    (["--attn_gate_layers=2,7", "--attention_free_layers=7"], "--attn_gate_layers: block 7 has no attention"),
    (["--attn_gate_layers=2", "--attn_output_gate=false"], "--attn_gate_layers: chooses blocks"),
    (["--attn_gate_layers=2,x"], "--attn_gate_layers"),
])
def test_gate_layer_refusals_in_one_line(flags, words, capsys):
    assert tg.main(["--preset=tiny", "--dry_run", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and len(err.splitlines()) == 1


def test_the_flag_reads_auto_and_an_empty_list():
    assert tg.parse_args(["--preset=tiny", "--attn_gate_layers=auto"]).attn_gate_layers is None
    assert tg.parse_args(["--preset=tiny", "--attn_gate_layers="]).attn_gate_layers == ()
    assert tg.parse_args(["--preset=tiny", "--attn_gate_layers=3,1"]).attn_gate_layers == (3, 1)
