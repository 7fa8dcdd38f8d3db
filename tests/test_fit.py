"""memfit.fit: one call that profiles, plans and applies, and its cache between runs.

Models: memfit's zoo GPT (the one memfit was built around) and Hugging Face GPT-2 from a config
with its defaults, each trained by a loop written here beside a plain copy."""

import copy
import json
import logging
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

import memfit
from memfit.errors import CacheWarning, MemfitError
from memfit.measure.memory import measured

from .conftest import tiny_gpt


def _step(model, batch, opt) -> tuple[torch.Tensor, int]:
    """One step of a plain loop (zero_grad, forward, loss, backward, AdamW) and its exact CPU
    peak: what lives at its start plus the highest rise during it."""
    opt.zero_grad(set_to_none=True)
    state = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]

    def step() -> torch.Tensor:
        loss = memfit.default_loss(model(**batch))  # the output's .loss, the output dropped (the planned step)
        loss.backward()
        opt.step()
        return loss.detach()
    loss, peak, _ = measured(step, lambda: [*model.parameters(), *model.buffers(), *state, *batch.values()])
    return loss, peak


def _hf_gpt2():
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=4, n_embd=64, n_head=2, vocab_size=256, n_positions=64)
    ids = torch.randint(0, 256, (4, 32))
    return transformers.GPT2LMHeadModel(config), {"input_ids": ids, "labels": ids}


def _fits_and_trains_as_plain(build, tmp_path):
    model, batch = build()
    plain = copy.deepcopy(model)
    unplanned = memfit.predict(memfit.profile(copy.deepcopy(model), batch, repeat=1), {}).peak_bytes
    budget = int(unplanned * 0.9)
    sched = memfit.fit(model, batch, budget, cache_dir=tmp_path)
    assert 0 < len(sched.checkpointed) < len(sched.policies), sched.policies
    for m in (plain, model):
        m.train()
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (plain, model)]
    for step in range(3):
        results = []
        for m, opt in zip((plain, model), opts, strict=True):
            torch.manual_seed(step)
            loss, peak = _step(m, batch, opt)
            results.append((loss, {n: p.grad.clone() for n, p in m.named_parameters()}, peak))
        (l1, g1, _), (l2, g2, peak) = results
        assert torch.equal(l1, l2) and all(torch.equal(g1[n], g2[n]) for n in g1), step
        if step:  # the first step makes the optimizer's state: steady from the second on
            assert peak <= budget and abs(peak - sched.predicted_peak_bytes) <= 64, (peak, sched.predicted_peak_bytes)


def test_fit_on_the_zoo_gpt_trains_within_its_budget_as_the_plain_model(tmp_path):
    _fits_and_trains_as_plain(tiny_gpt, tmp_path)


def test_fit_on_hugging_face_gpt2_trains_within_its_budget_as_the_plain_model(tmp_path):
    _fits_and_trains_as_plain(_hf_gpt2, tmp_path)


_SCRIPT = textwrap.dedent("""
    import json, logging, os, sys, time
    sys.path.insert(0, {root!r})
    import memfit
    logging.basicConfig(format="%(message)s", level=logging.INFO)  # the script shows memfit's line
    import memfit.runtime.apply  # imports torch._dynamo (1.7 s), as creating any torch optimizer does: not timed
    from tests.conftest import tiny_gpt
    if os.environ.get("NO_PROFILE"):
        def refuse(*a, **k):
            raise SystemExit("profiled")
        memfit.profile = refuse
    model, batch = tiny_gpt()
    t = time.perf_counter()
    sched = memfit.fit(model, batch, "5MB", cache_dir={cache!r})
    print(json.dumps({{"seconds": time.perf_counter() - t, "policies": sched.to_dict()["policies"]}}))
""")


def test_a_second_process_loads_the_plan_from_the_cache(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT.format(root=root, cache=str(tmp_path / "cache")))

    def run(**env):
        out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                             env={**os.environ, **env}, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr

    first, said = run()
    assert "profiled in" in said
    second, said = run(NO_PROFILE="1")  # memfit.profile raises in this process: the plan must come from the cache
    assert "from the cache" in said
    assert second["policies"] == first["policies"] and any(p != "none" for p in first["policies"].values())
    assert second["seconds"] * 4 <= first["seconds"], (first["seconds"], second["seconds"])


class _Counted:
    def __init__(self, monkeypatch):
        import memfit.fitting

        self.calls = 0
        real = memfit.fitting.profile

        def counted(*args, **kwargs):
            self.calls += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(memfit.fitting, "profile", counted)  # what fit calls


def test_a_changed_model_shape_step_or_version_misses_the_cache(tmp_path, monkeypatch):
    profiles = _Counted(monkeypatch)
    model, batch = tiny_gpt()

    def fit(m=model, b=batch, **kw):
        memfit.fit(m, b, "8MB", cache_dir=tmp_path, repeat=1, **kw)

    fit()
    fit()
    assert profiles.calls == 1  # the same call again: a hit
    memfit.fit(model, batch, "7MB", cache_dir=tmp_path, repeat=1)
    assert profiles.calls == 1  # another budget replans from the cached profile
    from memfit.zoo import gpt

    fit(m=gpt(batch=4, seq=32, vocab=256, d_model=64, n_head=2, n_layer=3)[0])  # another architecture
    assert profiles.calls == 2
    fit(m=gpt(batch=4, seq=32, vocab=256, d_model=64, n_head=2, n_layer=4, dropout=0.2)[0])  # another setting
    assert profiles.calls == 3
    fit(b={k: v[:2] for k, v in batch.items()})  # another shape
    assert profiles.calls == 4
    fit(step=memfit.TrainStep(optimizer="sgd"))  # another step
    assert profiles.calls == 5
    monkeypatch.setattr(memfit.fitting, "__version__", "99.0")  # the version fit keys its cache by
    fit()
    assert profiles.calls == 6
    assert len(list(tmp_path.iterdir())) == 6  # an entry each


@pytest.mark.parametrize("damage", ["garbage", "truncated", "other-key", "other-model"])
def test_a_corrupt_or_stale_entry_is_ignored_with_a_warning(tmp_path, monkeypatch, damage):
    model, batch = tiny_gpt()
    first = memfit.fit(model, batch, "5MB", cache_dir=tmp_path, repeat=1)
    [entry] = tmp_path.iterdir()
    [plan] = entry.glob("plan-*.json")
    target = {"garbage": plan, "truncated": entry / "profile.json", "other-key": entry / "key.json",
              "other-model": plan}[damage]
    text = target.read_text()
    if damage == "garbage":
        target.write_text("{not json")
    elif damage == "truncated":
        target.write_text(text[: len(text) // 2])
        plan.unlink()
    elif damage == "other-key":
        data = json.loads(text)
        data["key"]["inputs"] = "input_ids=int64[9,9]"
        target.write_text(json.dumps(data))
    else:  # a well-formed plan of another model under this key
        data = json.loads(text)
        data["fingerprint"]["params_sha256"] = "0" * 64
        target.write_text(json.dumps(data))
    profiles = _Counted(monkeypatch)
    with pytest.warns(CacheWarning, match="ignored the cache entry"):
        again = memfit.fit(model, batch, "5MB", cache_dir=tmp_path, repeat=1)
    assert profiles.calls == (0 if damage in ("garbage", "other-model") else 1)  # the profile was still sound
    if profiles.calls == 0:
        assert again.policies == first.policies
    else:  # measured again: the same options, which of the identical blocks take them is a tie the new times break
        assert sorted(map(str, again.policies.values())) == sorted(map(str, first.policies.values()))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        memfit.fit(model, batch, "5MB", cache_dir=tmp_path, repeat=1)  # rewritten: a clean hit
    assert profiles.calls <= 1


def test_no_cache_and_the_cache_folder_from_the_environment(tmp_path, monkeypatch):
    model, batch = tiny_gpt()
    monkeypatch.setenv("MEMFIT_CACHE", str(tmp_path / "env"))
    memfit.fit(model, batch, "8MB", repeat=1)
    assert len(list((tmp_path / "env").iterdir())) == 1
    monkeypatch.setenv("MEMFIT_CACHE", str(tmp_path / "off"))
    memfit.fit(model, batch, "8MB", repeat=1, cache_dir=False)
    assert not (tmp_path / "off").exists()


def test_auto_budget_needs_a_gpu_or_a_target(tmp_path):
    model, batch = tiny_gpt()
    with pytest.raises(MemfitError, match="on the CPU give a size"):
        memfit.fit(model, batch, "auto", cache_dir=False)
    sched = memfit.fit(model, batch, "auto", target="h100", cache_dir=False)
    from memfit.devices import device_spec

    assert sched.budget_bytes == device_spec("h100").usable_bytes and sched.target == "h100"
    assert memfit.predict(memfit.estimate(tiny_gpt, target="h100"), sched.policies).peak_bytes == \
        sched.predicted_peak_bytes  # the fake copy of the real model is the model estimate builds


def test_fit_logs_one_line_and_fits_again_over_its_own_plan(tmp_path, caplog):
    model, batch = tiny_gpt()
    with caplog.at_level("INFO", logger="memfit"):
        memfit.fit(model, batch, "5MB", cache_dir=tmp_path, repeat=1)
        again = memfit.fit(model, batch, "8MB", cache_dir=tmp_path, repeat=1)  # a new budget, same model object
    lines = [r.getMessage() for r in caplog.records if r.name == "memfit"]
    assert len(lines) == 2 and lines[0].startswith("memfit: checkpointing") and "profiled in" in lines[0]
    assert "planned from the cached profile" in lines[1]
    assert again.checkpointed == [] and model.__dict__["_memfit_applied"].schedule is again
    assert logging.getLogger("memfit").handlers == []  # a library's logger: the application decides


def test_importing_memfit_imports_no_trainer_library():
    code = ("import sys, memfit, memfit.hf, memfit.fitting, memfit.integrations.trainers; "
            "print(sorted(m for m in ('transformers', 'lightning', 'pytorch_lightning', 'accelerate') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]"


def test_a_trainers_optimizer_is_read_by_name_or_rebuilt_with_its_settings():
    from memfit.integrations.trainers import optimizer_of, train_step

    params = [torch.nn.Parameter(torch.zeros(3))]
    named = {
        "adamw": torch.optim.AdamW(params), "adamw-foreach": torch.optim.AdamW(params, foreach=True),
        "adamw-fused": torch.optim.AdamW(params, fused=True), "adam-single": torch.optim.Adam(params, foreach=False),
        "sgd": torch.optim.SGD(params, lr=0.1), "sgd-momentum": torch.optim.SGD(params, lr=0.1, momentum=0.9),
    }
    for name, opt in named.items():
        assert optimizer_of(opt) == name

    class Wrapped:  # accelerate's AcceleratedOptimizer keeps the real one as .optimizer
        optimizer = torch.optim.AdamW(params, amsgrad=True, lr=0.5)

    factory = optimizer_of(Wrapped())
    # the settings that are on (amsgrad changes the state) in the recorded name and the cache key
    rebuilt = factory(params)
    assert type(rebuilt) is torch.optim.AdamW and rebuilt.defaults == Wrapped.optimizer.defaults
    assert factory.__qualname__ == "AdamW(amsgrad)"
    assert optimizer_of(torch.optim.Adagrad(params)).__qualname__ == "Adagrad"
    step = train_step(torch.optim.AdamW(params), precision="bf16-mixed", accumulate=4, clip=0.0)
    assert (step.optimizer_name, step.precision, step.accumulate, step.clip_grad_norm) == ("adamw", "amp-bf16", 4, None)
    with pytest.raises(MemfitError, match="does not know the precision"):
        train_step(torch.optim.AdamW(params), precision="64-true", accumulate=1, clip=None)


def test_auto_budget_on_cuda_is_the_free_memory_plus_this_process_less_the_margin(monkeypatch):
    """The CUDA path of budget='auto', with the card's answers stood in (no GPU here): an H100's
    free 60 GiB plus the 10 GiB this process's allocator holds, over H100's margin."""
    from memfit.devices import device_spec
    from memfit.fitting import resolve_budget

    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (60 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 10 * gib)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: device_spec("h100").title)
    n, said = resolve_budget("auto", torch.device("cuda", 0))
    margin = device_spec("h100").margin
    assert n == int(70 * gib / (1 + margin)) and f"less a {margin:.0%} allocator margin" in said
