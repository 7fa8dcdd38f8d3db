"""The Python API's most natural slips, as a user types them: each a MemfitError saying what to
pass, never an AttributeError from deep inside (issue 39, item 2)."""

import copy

import pytest
import torch

import memfit

from .conftest import tiny_gpt


def test_apply_takes_a_schedule_file_path_and_refuses_other_things(tmp_path):
    model, batch = tiny_gpt()
    prof = memfit.profile(copy.deepcopy(model), batch, repeat=1)
    lo, hi = memfit.min_budget_bytes(prof), memfit.predict(prof, {}).peak_bytes
    sched = memfit.plan(prof, (lo + hi) // 2)
    sched.save(tmp_path / "schedule.json")
    by_path = memfit.apply(copy.deepcopy(model), str(tmp_path / "schedule.json"))  # what users type first
    assert by_path.__dict__["_memfit_applied"].policies == sched.policies
    memfit.apply(copy.deepcopy(model), tmp_path / "schedule.json")  # a Path too
    with pytest.raises(memfit.MemfitError, match=r"takes a Schedule or a schedule file's path, not a dict.*"
                                                 r"load_schedule"):
        memfit.apply(copy.deepcopy(model), dict(sched.policies))
    with pytest.raises(memfit.MemfitError, match=r"no such file|not found|does not exist"):
        memfit.apply(copy.deepcopy(model), str(tmp_path / "missing.json"))


def test_fit_and_profile_say_what_to_pass_for_a_name_or_a_class():
    x = torch.randn(4, 8)
    with pytest.raises(memfit.MemfitError, match=r"not a name.*memfit plan --scenario vit"):
        memfit.fit("vit", x, "1GB", cache_dir=False)
    with pytest.raises(memfit.MemfitError, match=r"not its class: build it first, memfit.fit\(Linear\(...\)"):
        memfit.fit(torch.nn.Linear, x, "1GB", cache_dir=False)
    with pytest.raises(memfit.MemfitError, match=r"takes a torch\.nn\.Module, not a int"):
        memfit.profile(3, x)
    with pytest.raises(memfit.MemfitError, match=r"memfit.apply takes a model, not its class"):
        memfit.apply(torch.nn.Linear, "schedule.json")


def test_a_misspelt_input_key_is_named_with_what_forward_takes():
    transformers = pytest.importorskip("transformers")
    config = transformers.ViTConfig(image_size=32, patch_size=16, hidden_size=32, num_hidden_layers=2,
                                    num_attention_heads=2, intermediate_size=64, num_labels=2)
    model = transformers.ViTForImageClassification(config)
    with pytest.raises(memfit.MemfitError, match=r"'pixels', which forward does not name; it takes pixel_values"):
        memfit.fit(model, {"pixels": torch.randn(2, 3, 32, 32)}, "1GB", cache_dir=False)


def test_every_error_and_warning_lives_in_errors_and_is_exported():
    """One place for what memfit raises and warns (issue 40): every Exception or Warning class that
    any memfit module defines is defined in memfit.errors and exported by the package, so that a
    user can catch it by name; a user's mistake is a MemfitError (export's unknown form, say)."""
    import importlib
    import inspect
    import pkgutil

    import memfit.errors

    defined = {}
    for info in pkgutil.walk_packages(memfit.__path__, "memfit."):
        module = importlib.import_module(info.name)
        for name, obj in vars(module).items():
            if inspect.isclass(obj) and issubclass(obj, (Exception, Warning)) and obj.__module__ == info.name:
                defined[name] = info.name
    assert defined and set(defined.values()) == {"memfit.errors"}, defined
    assert set(defined) <= set(memfit.__all__)
    assert all(getattr(memfit, n) is getattr(memfit.errors, n) for n in defined)
    with pytest.raises(memfit.MemfitError, match="unknown form"):
        memfit.export.export(memfit.Schedule({}, 1, 0, 0.0, 0.0, "t", "none", "none", 0.0, {}), "deepspeed")


MOVED_SYMBOL = """
import torch.distributed._composable  # torch's own user of the symbol, loaded before it goes
import torch.utils.checkpoint as c
del c._checkpoint_without_reentrant_generator   # as a torch upgrade might move it
import memfit
from memfit import zoo

print("imported", memfit.__version__)
model, batch = zoo.gpt(batch=2, seq=16, vocab=64, d_model=16, n_head=2, n_layer=2)
try:
    memfit.profile(model, batch, repeat=1)   # its checkpointed step needs the symbol
except memfit.MemfitError as exc:
    print("refused:", exc)
"""


def test_a_private_torch_symbol_that_moved_fails_its_feature_not_the_import(tmp_path):
    """torch_private's stand-ins: memfit imports, and the checkpoint region that needs the moved
    symbol says which it is, as a MemfitError."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", MOVED_SYMBOL], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "imported" in proc.stdout
    assert "refused: this feature needs PyTorch's private torch.utils.checkpoint." \
           "_checkpoint_without_reentrant_generator (there since torch 2.1)" in proc.stdout, proc.stdout
