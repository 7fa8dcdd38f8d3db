"""Hugging Face KV caches off in training forwards of a scheduled model.

Causal LMs default to ``use_cache=True``: the forward appends each layer's keys and values to a
cache, and a checkpointed layer recomputed in the backward appends them a second time (a
16-token cache becomes 32 long, and with a padded ``attention_mask`` the backward fails). Hugging
Face's own ``gradient_checkpointing_enable()`` turns the cache off in training, and its Trainer
sets ``config.use_cache = False``; a scheduled model does the same, in every forward that
records a graph on a model in training mode. ``generate()`` and evaluation (``no_grad`` or
``eval()``) keep their cache. A cache handed in (``past_key_values``) in such a forward is refused:
the recomputation would write into it again.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from memfit.errors import MemfitError

_CACHES = ("past_key_values", "past_key_value", "layer_past", "cache")


def cache_off(model: nn.Module) -> list[RemovableHandle]:
    """A forward pre-hook on every module of ``model`` that has a config with ``use_cache`` and
    takes ``use_cache`` in its forward (a Hugging Face model, and the base model it wraps)."""
    handles = []
    for module in model.modules():
        if getattr(getattr(module, "config", None), "use_cache", None) is None:
            continue
        try:
            takes = "use_cache" in inspect.signature(module.forward).parameters
        except (TypeError, ValueError):
            continue
        if takes:
            handles.append(module.register_forward_pre_hook(_no_cache, with_kwargs=True))
    return handles


def _no_cache(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if not (module.training and torch.is_grad_enabled()):
        return None
    given = next((k for k in _CACHES if kwargs.get(k) is not None), None)
    if given is not None:
        raise MemfitError(
            f"memfit: this training forward of {type(module).__name__} was given {given}=...; a checkpointed layer "
            "would write into the cache again when the backward recomputes it: pass no cache in training forwards "
            "(or run them under torch.no_grad())")
    if kwargs.get("use_cache", module.config.use_cache):
        return args, {**kwargs, "use_cache": False}
    return None
