"""A schedule in other tools' forms, and what each form cannot say (``memfit export``).

- ``hf``: a Python file for Hugging Face transformers that turns its activation checkpointing on
  and then off again on every ``GradientCheckpointingLayer`` the plan keeps;
- ``torchtitan``: the ``[activation_checkpoint]`` table of torchtitan's TOML job config (up to
  v0.2.2): none, full, every k-th layer, or op-level SAC;
- ``sac``: a Python file that wraps each chosen module's forward in ``torch.utils.checkpoint``,
  with a ``create_selective_checkpoint_contexts`` policy where the plan keeps an op set.

Where a form cannot say what the plan says, it takes the nearest choice that uses no more memory
(a whole layer checkpointed; every layer) and says so in ``Exported.lost``, one line per loss,
which the command prints as warnings and the file carries as comments. Nothing here needs torch,
except the op names of an op set, read from ``runtime/op_sets.OP_SETS`` when the plan has one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from memfit.budget import format_bytes
from memfit.errors import MemfitError
from memfit.formats.schedule import Schedule
from memfit.policy import Children, Derive, Full, Keep, Nested, Policy, Segment, Selective

FORMS = {"hf": "Hugging Face transformers: a Python file with apply_memfit_plan(model)",
         "torchtitan": "torchtitan's [activation_checkpoint] TOML table",
         "sac": "PyTorch selective checkpointing: a Python file with apply_memfit_plan(model)"}
MARK = "exported by memfit export"  # in every file's first line: what a later export may overwrite
GEMM = "gemm"  # the op set whose outputs torchtitan's op-level SAC keeps too (every other mm aside)


@dataclass(slots=True)
class Exported:
    """One form of a plan: the file's text, what it checkpoints, and what it cannot say."""

    to: str
    text: str
    checkpointed: list[str]  # the modules (layers) the exported form checkpoints
    lost: list[str] = field(default_factory=list)  # one line per thing the form cannot say


def export(schedule: Schedule, to: str, source: str = "schedule.json") -> Exported:
    """``schedule`` in the form ``to`` (a key of ``FORMS``); ``source`` names it in the file."""
    if to not in FORMS:
        raise MemfitError(f"unknown form {to!r}; expected one of {', '.join(FORMS)}")
    policies = schedule.policies
    made = _hf(policies, str(schedule.fingerprint.get("model_class", ""))) if to == "hf" else (
        _torchtitan(policies) if to == "torchtitan" else _sac(policies))
    made.lost[:0] = _common_losses(schedule)
    peak, budget = format_bytes(schedule.predicted_peak_bytes), format_bytes(schedule.budget_bytes)
    head = [f"A memfit plan, {MARK} {source} --to {to}",
            f"model {schedule.fingerprint.get('model_class', '?')}, inputs {schedule.input_shapes or '?'}: "
            f"predicted peak {peak} within {budget}",
            *(["", "What this form cannot say (memfit export printed each as a warning):"] if made.lost else []),
            *(f"- {line}" for line in made.lost)]
    made.text = "\n".join(f"# {line}".rstrip() for line in head) + "\n" + made.text
    return made


def _common_losses(schedule: Schedule) -> list[str]:
    lost = []
    if schedule.shapes:
        largest = f" ({schedule.input_shapes})" if schedule.input_shapes else ""
        lost.append(f"the schedule has a plan for each of {len(schedule.shapes)} input shapes, switched by the inputs; "
                    f"this is the largest shape's plan{largest}, which fits every planned shape")
    if schedule.fallbacks:
        lost.append(f"its tighter fallback plans for memfit.tighten ({len(schedule.fallbacks)}) are left out")
    if schedule.edited:
        lost.append("its policies were edited after planning: the predicted peak above is the old plan's")
    return lost


def _group(notes: dict[str, list[str]]) -> list[str]:
    """One line per note, naming the units it concerns."""
    return [f"{_names(units)}: {note}" for note, units in notes.items()]


def _names(units: list[str]) -> str:
    return ", ".join(units) if len(units) <= 4 else f"{', '.join(units[:3])} ... {units[-1]} ({len(units)} units)"


def _whole_units(policies: dict[str, Policy], form: str) -> tuple[list[str], list[str]]:
    """The units a form that checkpoints whole layers checkpoints (every unit the plan does not
    keep), and what that loses: a finer option becomes its whole unit (no more memory, more
    recompute); a segment becomes its members, each on its own (a different peak)."""
    chosen: list[str] = []
    notes: dict[str, list[str]] = {}
    for unit, policy in policies.items():
        if isinstance(policy, Keep):
            continue
        chosen.append(unit)
        if isinstance(policy, Segment):
            if unit == policy.first:
                notes.setdefault(_segment_note(policies, policy, "layers checkpointed each"), []).append(unit)
        elif isinstance(policy, Nested):
            notes.setdefault(_nested_note(policy, f"has no form in {form}", "layer"), []).append(unit)
        elif not isinstance(policy, Full):
            notes.setdefault(f"{policy} has no form in {form}: the whole layer is "
                             "checkpointed instead (no more memory, more recompute)", []).append(unit)
    return chosen, _group(notes)


def _nested_note(policy: Nested, why: str, what: str) -> str:
    return (f"{policy} {why}: the whole {what} is checkpointed without the regions inside it (the forward keeps "
            "as much; its backward recomputes them at once, a higher peak: measure it)")


def _segment_note(policies: dict[str, Policy], segment: Segment, become: str) -> str:
    n = sum(p == segment for p in policies.values())
    return (f"the segment {segment.first}..{segment.last} becomes its {n} {become}: each keeps its input through the "
            f"forward ({n - 1} more than the segment) and its backward recomputes one unit at a time, not all at "
            "once: the peak differs from the plan's (measure it)")


# --- Hugging Face transformers ----------------------------------------------------------------

_HF = '''
CHECKPOINT = {checkpoint}  # the layers memfit checkpoints
KEEP = {keep}  # memfit's other units: these layers keep their activations


def apply_memfit_plan(model):
    """Checkpoint exactly the layers in CHECKPOINT, in place, as transformers does for all of them:
    its switch on, then off on every other GradientCheckpointingLayer. Call it instead of
    gradient_checkpointing_enable() (and without TrainingArguments(gradient_checkpointing=True),
    which would turn every layer on again)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    modules = dict(model.named_modules())
    for name in CHECKPOINT + KEEP:
        if not isinstance(modules.get(name), GradientCheckpointingLayer):
            what = "no such module" if name not in modules else type(modules[name]).__name__
            raise ValueError(f"{{name}} ({{what}}) is not a transformers GradientCheckpointingLayer of this "
                             "model: this plan was made for another model; export it with --to sac instead")
    if not CHECKPOINT:
        return model
    kwargs = {{"use_reentrant": False}}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x; the old name warns there
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    chosen = set(CHECKPOINT)
    for name, module in modules.items():
        if isinstance(module, GradientCheckpointingLayer):
            module.gradient_checkpointing = name in chosen
    return model
'''


def _hf(policies: dict[str, Policy], model_class: str) -> Exported:
    chosen, lost = _whole_units(policies, "transformers' per-layer switch")
    if not model_class.startswith("transformers."):
        lost.append(f"the plan is for {model_class}, not a transformers model: apply_memfit_plan refuses any unit "
                    "that is not a GradientCheckpointingLayer (--to sac checkpoints any module)")
    keep = [u for u in policies if u not in chosen]
    text = _HF.format(checkpoint=_list(chosen), keep=_list(keep))
    return Exported("hf", text, chosen, lost)


def _list(names: list[str]) -> str:
    one = repr(names)
    return one if len(one) <= 80 else "[\n" + "".join(f"    {n!r},\n" for n in names) + "]"


# --- torchtitan ---------------------------------------------------------------------------------

def _torchtitan(policies: dict[str, Policy]) -> Exported:
    """torchtitan (<= v0.2.2, torchtitan/config/job_config.py ``ActivationCheckpoint``) wraps each
    child of ``model.layers`` (torchtitan/distributed/activation_checkpoint.py): ``full`` all,
    ``selective`` with an integer k those whose count, a process-wide counter from 1, is a
    multiple of k (k = 2: the 2nd, 4th, ... layer), with ``op`` each under its op-level SAC."""
    units = list(policies)
    chosen, lost = _whole_units(policies, "torchtitan's layer-level options")
    picked = [k for k, u in enumerate(units) if u in chosen]
    every = next((k for k in range(len(units), 1, -1) if all((i + 1) % k == 0 for i in picked)), 0)
    if not picked:
        mode, option, main = "none", "", "none"
    elif all(isinstance(p, Selective) and p.ops == GEMM and not p.child for p in policies.values()):
        mode, option, main, lost = "selective", "op", "selective", [
            f"{_names(units)}: {policies[units[0]]} becomes torchtitan's op-level SAC, which keeps the outputs of "
            "matrix products and attention kernels as memfit's op set does, but recomputes every second mm and "
            "also keeps max, topk and communication outputs"]
    elif len(picked) == len(units) or not every:
        mode, option, main = "full", "", "full"
        if len(picked) < len(units):
            lost.append(f"memfit checkpoints {len(picked)} of {len(units)} layers ({_names(chosen)}), which no "
                        "every-k choice covers: every layer is checkpointed (less memory, more recompute)")
    else:
        mode, option, main = "selective", str(every), "full"
        extra = [units[i] for i in range(every - 1, len(units), every) if i not in picked]
        if extra:
            lost.append(f"checkpointing every {every} layers (selective_ac_option {every}) also checkpoints "
                        f"{_names(extra)}, which memfit keeps (less memory, more recompute)")
        lost.append("torchtitan since 2026-03 (#2357) has no every-k option: activation-checkpoint:full there")
    if not all(re.fullmatch(rf"(.+\.)?layers\.{k}", u) for k, u in enumerate(units)):
        lost.append(f"torchtitan counts the children of model.layers; this plan's units are {_names(units)}: "
                    "this assumes they are those layers, in order")
    if mode == "selective" and option != "op":
        lost.append("torchtitan's layer count is per process and never reset: with pipeline stages it counts "
                    "each rank's own layers, not the model's")
    line = f'\nselective_ac_option = "{option}"' if option else ""
    cli = f"--activation_checkpoint.mode {mode}" + (f" --activation_checkpoint.selective_ac_option {option}"
                                                     if option else "")
    text = (f"#\n# torchtitan <= v0.2.2 TOML job config; on its command line: {cli}\n"
            f"# torchtitan main (Python config, since 2026-02): activation-checkpoint:{main}\n"
            f'[activation_checkpoint]\nmode = "{mode}"{line}\n')
    return Exported("torchtitan", text, [units[i] for i in _layers(mode, option, len(units), picked)], lost)


def _layers(mode: str, option: str, n: int, picked: list[int]) -> list[int]:
    """The layer indices torchtitan checkpoints under ``mode`` and ``option``."""
    if mode == "none":
        return []
    if mode == "full" or option == "op":
        return list(range(n))
    return [i for i in range(n) if (i + 1) % int(option) == 0]


# --- PyTorch selective checkpointing -------------------------------------------------------------

_SAC = '''
import functools
import weakref

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

_aten = torch.ops.aten


def _ops(*names):
    return frozenset(getattr(_aten, n).default for n in names if hasattr(_aten, n))
{op_sets}

# module -> the policy of its checkpoint; None: recompute everything (a plain checkpoint, which
# SAC's dispatch mode would only slow down)
PLAN = {{
{plan}}}


def apply_memfit_plan(model):
    """Checkpoint each module in PLAN, in place: its forward runs inside torch.utils.checkpoint
    (non-reentrant, so gradients and hooks work as usual; RNG state preserved for dropout)."""
    for name, policy in PLAN.items():
        module = model.get_submodule(name)
        if isinstance(module.__dict__.get("forward"), _Checkpointed):
            raise RuntimeError(f"{{name}} is checkpointed already: apply the plan once")
        module.forward = _Checkpointed(module, policy)
    return model


class _Checkpointed:
    """A module's forward under torch.utils.checkpoint; copy.deepcopy carries it to the copy's module."""

    def __init__(self, module, policy):
        self.module, self.policy = weakref.ref(module), policy
        self.own = module.__dict__.get("forward")  # a forward set on the instance before, if any

    def __reduce__(self):
        return (_Checkpointed, (self.module(), self.policy))

    def __call__(self, *args, **kwargs):
        module = self.module()
        forward = self.own or functools.partial(type(module).forward, module)
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        extra = {{}} if self.policy is None else {{
            "context_fn": functools.partial(create_selective_checkpoint_contexts, self.policy)}}
        return checkpoint(functools.partial(forward, **kwargs), *args, use_reentrant=False, **extra)
'''

_KEEP = '''

# memfit's op set "{name}": these ops' outputs are kept, everything else in the module recomputed
{const} = _ops({names})


def keep_{name}(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in {const} else CheckpointPolicy.PREFER_RECOMPUTE
'''


def _sac(policies: dict[str, Policy]) -> Exported:
    known = _op_sets(policies)
    plan: list[tuple[str, str | None, str]] = []  # module, policy function, why
    notes: dict[str, list[str]] = {}
    for unit, policy in policies.items():
        why = f"{unit}: {policy}"
        if isinstance(policy, Selective) and policy.ops in known:
            plan.append((f"{unit}.{policy.child}" if policy.child else unit, f"keep_{policy.ops}", why))
        elif isinstance(policy, Children) and all(len(r) == 1 for r in policy.regions):
            plan += [(f"{unit}.{r[0]}", None, why) for r in policy.regions]
        elif isinstance(policy, Nested) and all(len(r) == 1 for r in policy.inner.regions):
            # checkpoint calls nest: the unit's, and inside it each region's
            plan += [(unit, None, why), *((f"{unit}.{r[0]}", None, why) for r in policy.inner.regions)]
        elif isinstance(policy, Nested):
            plan.append((unit, None, why))
            notes.setdefault(_nested_note(policy, "has a chain of modules, which needs memfit's regions", "unit"),
                             []).append(unit)
        elif isinstance(policy, Derive) and policy.child:
            plan.append((f"{unit}.{policy.child}", None, why))
            notes.setdefault(f"{policy}: re-deriving saved tensors has no torch.utils.checkpoint form; the child "
                             "is checkpointed instead (no more memory, more recompute)", []).append(unit)
        elif not isinstance(policy, Keep):
            plan.append((unit, None, why))
            if isinstance(policy, Segment):
                if unit == policy.first:
                    notes.setdefault(_segment_note(policies, policy, "units checkpointed each"), []).append(unit)
            elif not isinstance(policy, Full):
                reason = {Derive: "re-deriving saved tensors has no torch.utils.checkpoint form",
                          Children: "a chain of modules checkpointed as one needs memfit's regions",
                          Selective: f"the op set {getattr(policy, 'ops', '')!r} is not memfit's"}[type(policy)]
                notes.setdefault(f"{policy}: {reason}; the whole unit is checkpointed instead (no more memory, "
                                 "more recompute)", []).append(unit)
    width = max((len(repr(m)) for m, _, _ in plan), default=0)
    rows = "".join(f"    {m!r}:{' ' * (width - len(repr(m)))} {fn},  # {why}\n" for m, fn, why in plan)
    keeps = "".join(_KEEP.format(name=name, const=name.upper(), names=", ".join(repr(o) for o in ops))
                    for name, ops in known.items() if any(fn == f"keep_{name}" for _, fn, _ in plan))
    return Exported("sac", _SAC.format(op_sets=keeps, plan=rows), [m for m, _, _ in plan], _group(notes))


def _op_sets(policies: dict[str, Policy]) -> dict[str, list[str]]:
    """The aten op names of memfit's op sets (runtime/op_sets.OP_SETS), read only when the plan
    keeps one: reading them imports torch."""
    if not any(isinstance(p, Selective) for p in policies.values()):
        return {}
    from memfit.runtime.op_sets import OP_SETS

    return {name: sorted(str(op).split(".")[1] for op in ops) for name, ops in OP_SETS.items()}
