"""Hugging Face causal LMs with their configs' defaults (``use_cache=True``), padded attention
masks and eager or SDPA attention, in a plain training loop; and HF's own checkpointing turned
on over a plan."""

import copy
import warnings

import pytest
import torch

import memfit
from memfit.formats.schedule import Schedule, model_fingerprint
from memfit.policy import FULL, KEEP, Segment, parse
from memfit.runtime.harness import StepHarness
from memfit.trainstep import TrainStep

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()


def _gpt2(attn: str):
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=4, n_embd=64, n_head=2, vocab_size=256, n_positions=64,
                                     attn_implementation=attn)
    return config, transformers.GPT2LMHeadModel(config), [f"transformer.h.{i}" for i in range(4)]


def _llama(attn: str):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(num_hidden_layers=4, hidden_size=64, intermediate_size=128,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                      max_position_embeddings=64, attn_implementation=attn)
    return config, transformers.LlamaForCausalLM(config), [f"model.layers.{i}" for i in range(4)]


def _batch():
    torch.manual_seed(1)
    ids = torch.randint(0, 256, (3, 16))
    mask = torch.ones_like(ids)
    mask[0, 12:] = 0  # padded on the right, as a collator pads
    mask[1, :3] = 0  # and on the left
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _schedule(model, policies) -> Schedule:
    return Schedule(policies, 1, 0, 0.0, 0.0, "test", "none", "none", 0.0, model_fingerprint(model, list(policies)))


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("build", [_gpt2, _llama], ids=["gpt2", "llama"])
@pytest.mark.parametrize("kind", ["full", "segment"])
def test_causal_lms_with_their_default_cache_train_as_the_plain_model(build, attn, kind):
    config, plain, names = build(attn)
    assert config.use_cache  # the default every pretrained config has
    plain.train()
    model = copy.deepcopy(plain)
    seg = Segment(names[0], names[2])
    policies = (dict.fromkeys(names, FULL) if kind == "full"
                else {**dict.fromkeys(names[:3], seg), names[3]: FULL})
    memfit.apply(model, _schedule(model, policies))
    batch = _batch()
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (plain, model)]
    for step in range(3):
        results = []
        for m, opt in zip((plain, model), opts, strict=True):
            opt.zero_grad(set_to_none=True)
            torch.manual_seed(step)
            out = m(**batch)  # use_cache left to the config: True
            out.loss.backward()
            opt.step()
            results.append((out.loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters()}))
            if m is model:
                assert out.past_key_values is None  # the training forward ran without a cache
        (l1, g1), (l2, g2) = results
        assert torch.equal(l1, l2), step
        assert all(torch.equal(g1[n], g2[n]) for n in g1), step
    with torch.no_grad():  # evaluation and generate() keep their cache
        out = model(**batch)
        assert out.past_key_values is not None and out.past_key_values.get_seq_length() == 16
        generated = model.generate(batch["input_ids"][:1, :8], max_new_tokens=4, do_sample=False)
        assert generated.shape == (1, 12)


def test_a_cache_handed_to_a_training_forward_is_refused():
    _, model, names = _gpt2("sdpa")
    memfit.apply(model, _schedule(model, dict.fromkeys(names, FULL)))
    with torch.no_grad():
        cache = model(input_ids=torch.randint(0, 256, (1, 4))).past_key_values
    with pytest.raises(memfit.MemfitError, match=r"cache=.*write into the cache again"):
        model(input_ids=torch.randint(0, 256, (1, 4)), cache=cache)


def test_profile_plan_validate_on_a_padded_batch_with_the_default_cache():
    """memfit.profile on such a batch used to fail in the backward; now the plan is exact."""
    _, model, names = _gpt2("eager")
    batch = _batch()
    prof = memfit.profile(model, batch, units=names, repeat=1)
    lo, hi = memfit.min_budget_bytes(prof), memfit.predict(prof, {}).peak_bytes
    sched = memfit.plan(prof, (lo + hi) // 2)
    check = memfit.validate(model, batch, sched, steps=0)
    assert check.ok and check.measured_peak_bytes == check.predicted_peak_bytes


def test_hf_checkpointing_turned_on_over_a_plan_is_named():
    """The Trainer's gradient_checkpointing=True calls gradient_checkpointing_enable(): the
    results stay right, and memfit says its plan is overridden, once."""
    _, model, names = _gpt2("sdpa")
    plain = copy.deepcopy(model)
    memfit.apply(model, _schedule(model, {n: (FULL if i % 2 else KEEP) for i, n in enumerate(names)}))
    model.train()
    batch = _batch()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(**batch)  # not yet: quiet
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    with pytest.warns(memfit.MemfitWarning, match="Hugging Face gradient checkpointing is on"):
        torch.manual_seed(0)
        loss = model(**batch).loss
    loss.backward()
    torch.manual_seed(0)
    plain.train()
    ref = plain(**batch).loss
    ref.backward()
    assert torch.equal(loss, ref)
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), plain.parameters(), strict=True))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(**batch)  # once


class _Lengths(torch.utils.data.Dataset):
    """Token rows of 4 to ``longest`` tokens, for a collator that pads each batch to its longest."""

    def __init__(self, longest: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.rows = [torch.randint(1, 256, (int(torch.randint(4, longest + 1, (1,), generator=g)),), generator=g)
                     for _ in range(48)]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[i]}


def _pad(rows):
    n = max(len(r["input_ids"]) for r in rows)
    ids = torch.zeros(len(rows), n, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, : len(r["input_ids"])] = r["input_ids"]
        mask[i, : len(r["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _trainer(model, data, steps, collator=None):
    pytest.importorskip("accelerate")
    args = transformers.TrainingArguments(
        output_dir="unused", per_device_train_batch_size=4, max_steps=steps, learning_rate=0.05, use_cpu=True,
        report_to=[], save_strategy="no", logging_strategy="no", seed=0, disable_tqdm=True)
    return transformers.Trainer(model=model, args=args, train_dataset=data, data_collator=collator)


def test_the_trainer_on_dynamic_padding_warns_only_for_longer_batches(tmp_path, monkeypatch):
    """12 steps whose batches are padded to their longest row, at most the planned 16 tokens:
    no warning (the Trainer's num_items_in_batch, a 0-d tensor, is not an input that grows); rows up
    to 24 tokens: a warning for each new longest batch only, each naming a longer input."""
    monkeypatch.chdir(tmp_path)
    _, model, names = _gpt2("sdpa")
    planned = "input_ids=int64[4,16], attention_mask=int64[4,16], labels=int64[4,16]"
    sched = _schedule(model, dict.fromkeys(names, FULL))
    sched.input_shapes = planned
    memfit.apply(model, sched)
    for longest, most in ((16, 0), (24, 8)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _trainer(model, _Lengths(longest), 12, _pad).train()
        ours = [str(w.message) for w in caught if issubclass(w.category, memfit.MemfitWarning)]
        assert len(ours) <= most and (most == 0) == (not ours), ours
        lengths = [int(m.split("input_ids int64[4,")[1].split("]")[0]) for m in ours]
        assert lengths == sorted(set(lengths)) and all(n > 16 for n in lengths)  # each a new longest


class _Images(torch.utils.data.Dataset):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(24, 3, 32, 32, generator=g)
        self.y = torch.randint(0, 10, (24,), generator=g)

    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"pixel_values": self.x[i], "labels": self.y[i]}


def test_the_trainer_on_a_resnet_from_pretrained_trains_as_the_plain_model(tmp_path, monkeypatch):
    """from_pretrained (eval mode) -> apply -> Trainer: weights and BatchNorm buffers equal to a
    plain model's trained by the same Trainer."""
    from .models import hf_resnet

    monkeypatch.chdir(tmp_path)
    hf_resnet()[0].save_pretrained(tmp_path / "m")
    trained = []
    for scheduled in (False, True):
        model = transformers.ResNetForImageClassification.from_pretrained(tmp_path / "m")
        if scheduled:
            names = [f"resnet.encoder.stages.{i}.layers.{j}" for i in range(4) for j in range(2)]
            memfit.apply(model, _schedule(model, dict.fromkeys(names, FULL)))
        _trainer(model, _Images(), 4).train()
        trained.append(model)
    plain, model = trained
    assert all(torch.equal(p, q) for p, q in zip(plain.parameters(), model.parameters(), strict=True))
    assert all(torch.equal(b, c) for b, c in zip(plain.buffers(), model.buffers(), strict=True))


def _predicted_and_measured(prof, plain, batch, step, policies):
    """The profile's prediction for ``policies`` and a copy of ``plain`` under them measured phase
    by phase (``StepHarness.levels``: (mark, level, peak)) in ``step``."""
    model = memfit.apply(copy.deepcopy(plain), _schedule(plain, policies))
    return memfit.predict(prof, policies), StepHarness(model, batch, step=step).levels(prof.unit_names)


def test_a_padded_batchs_mask_is_counted_where_a_checkpoint_keeps_it():
    """Hugging Face decoders make the padded batch's 4-D attention mask (and the cache positions,
    the rotary tables) once, before the blocks, and hand them to every block. A checkpointed block
    keeps them for its recompute; ``derive`` keeps nothing autograd would not, so they go with the
    forward as in the plain step (profile: ``holds_outside`` False). The step's peak, and each
    phase's level and peak, are then predicted to the byte, for plans of ``derive`` alone (before:
    the remainders' checkpointed figures, 1,920 bytes over on Llama) and mixed with ``full``; the
    last unit's tail, which re-makes the final norm's output in the head's backward, is booked in
    the unit's own backward (profiler/phases.add_tail), so those two phases are read as one."""
    _, plain, names = _llama("sdpa")
    plain.train()
    batch = _batch()
    prof = memfit.profile(copy.deepcopy(plain), batch, units=names, optimizer="adamw", repeat=1, granularity="fine")
    derive = parse("derive")
    assert [u.options[derive].holds_outside for u in prof.units if derive in u.options] == [False] * 4
    assert all(u.options[FULL].holds_outside for u in prof.units)
    # mixed: the first unit full, whose backward, the step's last, frees what the checkpoints kept
    # (with it kept, the model leaves those bytes held to the step's end: cautious)
    for spelt in (["derive"] * 4, ["full", "derive", "derive", "none"]):
        policies = {n: parse(p) for n, p in zip(names, spelt, strict=True)}
        prediction, measured = _predicted_and_measured(prof, plain, batch, TrainStep(optimizer="adamw"), policies)
        assert prediction.peak_bytes == max(peak for _, _, peak in measured), spelt
        folded = {"backward of loss and head", f"backward {names[-1]}"}
        assert [(lvl, peak) for label, lvl, peak in prediction.levels if label not in folded] == [
            (lvl, peak) for (label, *_), (_, lvl, peak) in zip(prediction.levels, measured, strict=True)
            if label not in folded], spelt


def test_grouped_kv_attention_follows_its_learned_derive_plan():
    """Llama's eager attention with grouped KV heads: ``repeat_kv`` makes k contiguous, and the
    matmul of q and kᵀ folds their batch dimensions with a reshape that autograd records as
    ``_reshape_alias`` in eager mode but as ``view`` under the learning forward's dispatch mode.
    Under ``derive:projections`` every later forward follows the learned plan (before: each missed
    it and learned again, and a step of two micro-batches had the profile refuse the unit), and
    three training steps match the plain model's."""
    from memfit.runtime.derive_plan import Plan

    from .test_apply import _assert_identical, _run

    _, plain, names = _llama("eager")
    batch = _batch()
    model = memfit.apply(copy.deepcopy(plain), _schedule(plain, dict.fromkeys(names, parse("derive:projections"))))
    _assert_identical(_run(copy.deepcopy(plain), batch, steps=3), _run(model, batch, steps=3))
    units = [model.get_submodule(n).__dict__["_memfit_derive"] for n in names]
    assert all(not d.misses and [type(p) for p in d.plans.values()] == [Plan] for d in units)
    assert all(d.derived_bytes > 0 for d in units)


def test_a_checkpoint_that_keeps_the_mask_raises_the_heads_peak_under_autocast():
    """BLOOM under bf16 autocast, a padded batch: the plain step frees the mask and the ALiBi
    tensor when the model's forward returns, before the head and the loss peak; with a block
    checkpointed they are kept there, and the all-checkpointed step does not show it (its last block,
    checkpointed, lowers that peak). With one middle block checkpointed, the level and the peak
    there are predicted to the byte (before: the peak 8,064 bytes over its prediction), and the
    step's peak is never under the measured one."""
    torch.manual_seed(0)
    config = transformers.BloomConfig(vocab_size=256, n_layer=4, hidden_size=64, n_head=4)
    plain, names = transformers.BloomForCausalLM(config), [f"transformer.h.{i}" for i in range(4)]
    plain.train()
    batch = _batch()
    step = TrainStep(optimizer="adamw", precision="amp-bf16")
    prof = memfit.profile(copy.deepcopy(plain), batch, units=names, step=step, repeat=1)
    policies = {n: FULL if i == 1 else KEEP for i, n in enumerate(names)}
    predicted, measured = _predicted_and_measured(prof, plain, batch, step, policies)
    k = next(i for i, (label, *_) in enumerate(predicted.levels) if label.endswith("(head, loss)"))
    assert predicted.levels[k][1:] == tuple(measured[k][1:])
    assert predicted.peak_bytes >= max(peak for _, _, peak in measured)


def test_a_checkpoint_that_keeps_its_input_is_booked_to_its_unit_under_autocast():
    """BERT under bf16 autocast: the next block's products save bf16 casts of its fp32 input, so
    the plain step frees that hidden state right after the block that takes it; a checkpointed block
    keeps it for its recompute. That is the block's own doing (``freed_after_bytes`` negative), not
    something every checkpoint keeps: with one block checkpointed, every level of the forward is
    predicted to the byte (before: one hidden state high after each later block), and so is every
    peak but the checkpointed block's remainder's, which counts the kept input from its start (the
    plain step might free it before that peak: roles.kept_after), one hidden state high."""
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=256, num_hidden_layers=4, hidden_size=64, intermediate_size=160,
                                     num_attention_heads=4, max_position_embeddings=64)
    plain, names = transformers.BertForMaskedLM(config), [f"bert.encoder.layer.{i}" for i in range(4)]
    plain.train()
    batch = _batch()
    step = TrainStep(optimizer="adamw", precision="amp-bf16")
    prof = memfit.profile(copy.deepcopy(plain), batch, units=names, step=step, repeat=1)
    hidden = 3 * 16 * 64 * 4
    assert [u.options[FULL].freed_after_bytes for u in prof.units][1:3] == [-hidden, -hidden]
    policies = {n: FULL if i == 1 else KEEP for i, n in enumerate(names)}
    predicted, measured = _predicted_and_measured(prof, plain, batch, step, policies)
    forward = [i for i, (label, *_) in enumerate(predicted.levels) if label.startswith("forward")][:-1]
    assert [predicted.levels[i][1] for i in forward] == [measured[i][1] for i in forward]
    kept = {f"forward after {names[1]}": hidden}
    assert [predicted.levels[i][2] for i in forward] == [
        measured[i][2] + kept.get(predicted.levels[i][0], 0) for i in forward]
    assert predicted.peak_bytes >= max(peak for _, _, peak in measured)
