"""The one patch of a transformers private: its check of a model's ``attn_implementation``, wrapped.

>>> from transformers import PreTrainedModel
>>> getattr(PreTrainedModel, HOOK).checks_sparse_attn        # wrapped when the integration was imported
True
>>> wrap_attn_implementation_check(lambda model, asked: asked, lambda model, chosen: None)  # again: a no-op
True

transformers runs ``PreTrainedModel._check_and_adjust_attn_implementation`` whenever a model is built, loaded
or switched to another ``attn_implementation``; no public hook exists for that moment. If an installed
transformers lacks it, the integration still runs but cannot check models or restore a saved pattern's
implementation: a ``RuntimeWarning`` says so, naming the transformers version.
"""
from __future__ import annotations

import functools
import warnings
from collections.abc import Callable

import transformers
from transformers import PreTrainedModel

HOOK = "_check_and_adjust_attn_implementation"  # a private of PreTrainedModel: present in transformers 5.24


def wrap_attn_implementation_check(request: Callable, check: Callable) -> bool:
    """Wrap transformers' check once: ``request(model, attn_implementation)`` says which implementation to ask it
    for, and ``check(model, chosen)`` inspects the model with the implementation it chose. Returns whether the
    check is wrapped (False, with a warning, if this transformers has no such hook)."""
    adjust = getattr(PreTrainedModel, HOOK, None)
    if not callable(adjust):
        warnings.warn(f"transformers {transformers.__version__} has no PreTrainedModel.{HOOK}, which "
                      f"sparse_attn.integrations.transformers wraps to check models when they are built: models it "
                      f"cannot run are not refused, from_pretrained(path) of a model saved with sparse_attn_pattern "
                      f"loads transformers' default attention, and an unregistered sparse_attn name gets "
                      f"transformers' own error. Pass attn_implementation= explicitly and call check_model(model), "
                      f"or install a transformers that has it (5.24, which the integration is tested with, does)",
                      RuntimeWarning, stacklevel=2)
        return False
    if getattr(adjust, "checks_sparse_attn", False):
        return True

    @functools.wraps(adjust)
    def check_and_adjust(model, attn_implementation, *args, **kwargs):
        chosen = adjust(model, request(model, attn_implementation), *args, **kwargs)
        check(model, chosen)
        return chosen

    check_and_adjust.checks_sparse_attn = True  # type: ignore[attr-defined]  # a mark on a function object
    setattr(PreTrainedModel, HOOK, check_and_adjust)
    return True
