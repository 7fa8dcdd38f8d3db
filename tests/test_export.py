"""``memfit export``: a plan in Hugging Face transformers', torchtitan's and PyTorch's selective
checkpointing's forms. Each exported file is run on a fresh model: one training step's exact CPU
peak against memfit.apply's for the same plan, losses and gradients against the plain model's."""

from __future__ import annotations

import copy
import json

import pytest
import torch

import memfit
from memfit.cli import main
from memfit.export import export
from memfit.formats.schedule import Schedule, model_fingerprint
from memfit.measure.memory import measured
from memfit.policy import FULL, KEEP, as_policies, parse
from memfit.scenarios import tomllib
from memfit.zoo import gpt

from .conftest import TINY, tiny_gpt
from .test_train_step import UserLoop

BLOCKS = [f"h.{i}" for i in range(4)]


def _schedule(model, policies: dict[str, str]) -> Schedule:
    return Schedule(policies, 1, 0, 0.0, 0.0, "test", "none", "none", 0.0, model_fingerprint(model, list(policies)))


def _plan_file(schedule: Schedule, to: str) -> dict:
    """The exported Python file, run: its namespace."""
    namespace: dict = {}
    exec(compile(export(schedule, to).text, f"<{to} export>", "exec"), namespace)
    return namespace


def _trained(model, batch) -> tuple[torch.Tensor, int, list[torch.Tensor]]:
    """Two AdamW steps of ``model`` (the first makes the optimizer's state); the second one's loss,
    exact CPU peak (what lives across steps plus the highest rise during it) and gradients."""
    model.train()
    loop = UserLoop(model, batch, "adamw", 1, "fp32", None)
    torch.manual_seed(0)  # the same dropout masks in every model
    loop.step()
    loop.opt.zero_grad(set_to_none=True)
    state = [v for s in loop.opt.state.values() for v in s.values() if torch.is_tensor(v)]
    torch.manual_seed(1)
    loss, peak, _ = measured(loop.step, lambda: [*model.parameters(), *model.buffers(), *state,
                                                 *(v for v in batch.values() if torch.is_tensor(v))])
    return loss, peak, [p.grad for p in model.parameters()]


def _same(a, b) -> bool:
    return torch.equal(a[0], b[0]) and all(torch.equal(x, y) for x, y in zip(a[2], b[2], strict=True))


@pytest.mark.parametrize("arch", ["gpt2", "llama"])  # the hf-gpt2 and hf-llama scenarios' models, small
def test_hf_export_checkpoints_exactly_the_planned_layers_at_memfits_peak(arch):
    """GPT-2 and Llama from transformers: the exported file turns HF's own checkpointing on for
    layers 1 and 3 only; the step's peak is memfit.apply's to the byte, and only those layers
    run twice."""
    pytest.importorskip("transformers")
    from memfit import hf as builders

    if arch == "gpt2":
        model, batch = builders.gpt2(batch=2, seq=32, n_layer=4, n_embd=64, n_head=2, vocab=256)
        layers, norm = [f"transformer.h.{i}" for i in range(4)], "ln_1"
    else:
        model, batch = builders.llama(batch=2, seq=32, n_layer=4, hidden=64, n_head=4, vocab=256)
        layers, norm = [f"model.layers.{i}" for i in range(4)], "input_layernorm"
    schedule = _schedule(model, {n: FULL if i % 2 else KEEP for i, n in enumerate(layers)})
    plain = _trained(copy.deepcopy(model), batch)
    ours = _trained(memfit.apply(copy.deepcopy(model), schedule), batch)
    hf = _plan_file(schedule, "hf")["apply_memfit_plan"](copy.deepcopy(model))
    assert [hf.get_submodule(n).gradient_checkpointing for n in layers] == [False, True, False, True]
    calls = dict.fromkeys(layers, 0)
    for name in layers:  # a layer's first norm runs once per step, twice where its layer is recomputed
        count = lambda *_, n=name: calls.__setitem__(n, calls[n] + 1)  # noqa: E731
        hf.get_submodule(f"{name}.{norm}").register_forward_pre_hook(count)
    exported = _trained(hf, batch)
    assert calls == {layers[0]: 2, layers[1]: 4, layers[2]: 2, layers[3]: 4}  # two steps each
    assert exported[1] == ours[1] < plain[1]
    assert _same(exported, plain)


def test_hf_export_of_finer_options_checkpoints_whole_layers_and_says_so():
    schedule = _schedule(gpt(batch=1, seq=8, vocab=16, d_model=16, n_head=2, n_layer=4)[0],
                         as_policies({"h.0": "selective:gemm", "h.1": "child:attn", "h.2": "derive", "h.3": "none"}))
    made = export(schedule, "hf")
    assert made.checkpointed == ["h.0", "h.1", "h.2"]
    assert "CHECKPOINT = ['h.0', 'h.1', 'h.2']" in made.text and "KEEP = ['h.3']" in made.text
    for unit, policy in (("h.0", "selective:gemm"), ("h.1", "child:attn"), ("h.2", "derive")):
        line = next(x for x in made.lost if x.startswith(f"{unit}: {policy} "))
        assert "the whole layer is checkpointed instead (no more memory" in line
        assert f"# - {line}" in made.text
    assert any("not a transformers model" in x for x in made.lost)  # memfit.zoo.GPT has no HF layers
    # nested regions: the layer checkpointed whole, and the note says its backward peaks higher
    made = export(_schedule(gpt(batch=1, seq=8, vocab=16, d_model=16, n_head=2, n_layer=4)[0],
                            {"h.0": parse("nested:attn+mlp"), "h.1": KEEP, "h.2": KEEP, "h.3": KEEP}), "hf")
    assert made.checkpointed == ["h.0"]
    line = next(x for x in made.lost if x.startswith("h.0: nested:attn+mlp "))
    assert "checkpointed without the regions inside it" in line and "a higher peak" in line


@pytest.mark.parametrize("kind", ["block", "fine", "nested"])
def test_sac_export_gives_memfits_peak_and_the_plain_gradients(kind):
    model, batch = tiny_gpt()
    policies = as_policies({
        "block": {"h.0": "none", "h.1": "full", "h.2": "none", "h.3": "full"},
        "fine": {"h.0": "selective:gemm", "h.1": "child:attn+mlp", "h.2": "selective:weights@attn", "h.3": "none"},
        # checkpoint calls nested as memfit nests its regions
        "nested": {"h.0": "nested:attn+mlp", "h.1": "full", "h.2": "nested:attn+mlp", "h.3": "none"}}[kind])
    schedule = _schedule(model, policies)
    made = export(schedule, "sac")
    assert not made.lost  # every one of these options has its exact SAC form
    plain = _trained(copy.deepcopy(model), batch)
    ours = _trained(memfit.apply(copy.deepcopy(model), schedule), batch)
    exported = _trained(_plan_file(schedule, "sac")["apply_memfit_plan"](copy.deepcopy(model)), batch)
    assert exported[1] == ours[1] < plain[1]
    assert _same(exported, plain)


def test_sac_export_of_what_it_cannot_say_uses_no_more_memory():
    """derive and a chain become whole-unit checkpoints, derive on a child that child's (measured
    below memfit's peak); a segment becomes one checkpoint per member, and the export says the
    peak differs."""
    model, batch = tiny_gpt()
    schedule = _schedule(model, as_policies({"h.0": "derive", "h.1": "child:ln_2>mlp.0", "h.2": "derive:products",
                                             "h.3": "derive@mlp"}))
    made = export(schedule, "sac")
    assert made.checkpointed == ["h.0", "h.1", "h.2", "h.3.mlp"]
    assert [x.split(":")[0] for x in made.lost] == ["h.0", "h.1", "h.2", "h.3"]
    ours = _trained(memfit.apply(copy.deepcopy(model), schedule), batch)
    exported = _trained(_plan_file(schedule, "sac")["apply_memfit_plan"](copy.deepcopy(model)), batch)
    assert exported[1] <= ours[1]
    assert _same(exported, _trained(copy.deepcopy(model), batch))
    seg = parse("segment:h.0..h.2")
    made = export(_schedule(model, {**dict.fromkeys(BLOCKS[:3], seg), "h.3": FULL}), "sac")
    assert made.checkpointed == BLOCKS
    assert len(made.lost) == 1 and "h.0..h.2 becomes its 3 units checkpointed each" in made.lost[0]
    assert "the peak differs" in made.lost[0]


@pytest.mark.parametrize(("policies", "mode", "option", "checkpointed", "lost"), [
    (dict.fromkeys(BLOCKS, KEEP), "none", None, [], []),
    (dict.fromkeys(BLOCKS, FULL), "full", None, BLOCKS, []),
    ({"h.0": KEEP, "h.1": FULL, "h.2": KEEP, "h.3": FULL}, "selective", "2", ["h.1", "h.3"],
     ["no every-k option"]),
    ({"h.0": KEEP, "h.1": KEEP, "h.2": KEEP, "h.3": FULL}, "selective", "4", ["h.3"], ["no every-k option"]),
    ({"h.0": KEEP, "h.1": FULL, "h.2": KEEP, "h.3": KEEP}, "selective", "2", ["h.1", "h.3"],
     ["also checkpoints h.3, which memfit keeps"]),
    ({"h.0": FULL, "h.1": KEEP, "h.2": FULL, "h.3": FULL}, "full", None, BLOCKS,
     ["memfit checkpoints 3 of 4 layers (h.0, h.2, h.3), which no every-k choice covers"]),
    (dict.fromkeys(BLOCKS, parse("selective:gemm")), "selective", "op", BLOCKS, ["recomputes every second mm"]),
    ({"h.0": KEEP, **dict.fromkeys(BLOCKS[1:], parse("segment:h.1..h.3"))}, "full", None, BLOCKS,
     ["h.1: the segment h.1..h.3 becomes its 3 layers checkpointed each"]),
], ids=["none", "all", "every-2nd", "last", "one-of-two", "irregular", "op", "segment"])
def test_torchtitan_export_checkpoints_at_least_every_planned_layer(policies, mode, option, checkpointed, lost):
    made = export(_schedule(gpt(batch=1, seq=8, vocab=16, d_model=16, n_head=2, n_layer=4)[0], policies),
                  "torchtitan")
    table = tomllib.loads(made.text)["activation_checkpoint"]
    assert table == {"mode": mode, **({"selective_ac_option": option} if option else {})}
    assert made.checkpointed == checkpointed
    assert set(made.checkpointed) >= {u for u, p in policies.items() if p != KEEP}  # never less checkpointing
    for words in lost:
        assert any(words in line for line in made.lost), (words, made.lost)
    assert any("children of model.layers" in x for x in made.lost)  # units h.N, not layers.N
    assert all(f"# - {line}" in made.text for line in made.lost)


def test_torchtitan_counts_layers_from_one_process_wide():
    """selective_ac_option k checkpoints the k-th, 2k-th, ... child of model.layers (torchtitan
    v0.2.2's counter starts at 1): with units named layers.N nothing is assumed about names."""
    policies = {f"layers.{i}": FULL if i in (2, 5) else KEEP for i in range(6)}
    made = export(Schedule(policies, 1, 0, 0.0, 0.0, "test", "none", "none", 0.0,
                           {"model_class": "x.Transformer", "units": list(policies), "params_sha256": ""}),
                  "torchtitan")
    assert tomllib.loads(made.text)["activation_checkpoint"]["selective_ac_option"] == "3"
    assert made.checkpointed == ["layers.2", "layers.5"]
    assert not any("children of model.layers" in x for x in made.lost)
    assert any("per process" in x for x in made.lost)


def test_cli_plans_then_exports_a_file_that_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny.toml").write_text(TINY)
    assert main(["profile", "--scenario", "tiny.toml", "--repeat", "1", "-o", "p.json"]) == 0
    prof = memfit.Profile.load(tmp_path / "p.json")
    budget = (memfit.min_budget_bytes(prof) + memfit.predict(prof, {}).peak_bytes) // 2
    assert main(["plan", "--profile", "p.json", "--budget", str(budget), "-o", "s.json"]) == 0
    schedule = memfit.load_schedule(tmp_path / "s.json")
    assert 0 < len(schedule.checkpointed) < len(schedule.policies)
    capsys.readouterr()
    assert main(["export", "s.json", "--to", "sac", "-o", "x.py", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["to"] == "sac" and out["file"].endswith("x.py") and out["checkpointed"] == schedule.checkpointed
    namespace: dict = {}
    exec((tmp_path / "x.py").read_text(), namespace)
    assert list(namespace["PLAN"]) == schedule.checkpointed
    model, batch = gpt(**tomllib.loads(TINY)["args"])
    namespace["apply_memfit_plan"](model)(**batch)["loss"].backward()
    assert main(["export", "s.json", "--to", "torchtitan"]) == 0  # to stdout
    assert "[activation_checkpoint]" in capsys.readouterr().out
    assert main(["export", "s.json", "--to", "hf", "-o", "x.py"]) == 0  # replaces its own export
    assert "GradientCheckpointingLayer" in (tmp_path / "x.py").read_text()


@pytest.mark.parametrize(("argv", "says"), [
    (["export", "missing.json", "--to", "sac"], "no such file; give a schedule JSON"),
    (["export", "p.json", "--to", "sac"], "is not a schedule; plan one first"),
    (["export", "s.json", "--to", "sac", "-o", "tiny.toml"], "is not a plan memfit exported; refusing to overwrite"),
    (["export", "s.json", "--to", "deepspeed"], "invalid choice: 'deepspeed'"),
    (["export", "s.json"], "required: --to"),
])
def test_cli_mistakes_exit_2_and_say_what_to_do(tmp_path, monkeypatch, capsys, argv, says):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny.toml").write_text(TINY)
    model = gpt(batch=1, seq=8, vocab=16, d_model=16, n_head=2, n_layer=4)[0]
    _schedule(model, dict.fromkeys(BLOCKS, FULL)).save(tmp_path / "s.json")
    (tmp_path / "p.json").write_text(json.dumps({"format": "memfit.profile/1"}))
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse's mistakes
        code = exit_.code
    err = capsys.readouterr().err
    assert code == 2 and says in err and "Traceback" not in err, err
    assert (tmp_path / "tiny.toml").read_text() == TINY


def test_export_help_shows_an_example(capsys):
    with pytest.raises(SystemExit) as done:
        main(["export", "--help"])
    out = capsys.readouterr().out
    assert done.value.code == 0 and "memfit export schedule.json --to hf -o memfit_plan.py" in out
    assert all(form in out for form in ("hf:", "torchtitan:", "sac:"))
