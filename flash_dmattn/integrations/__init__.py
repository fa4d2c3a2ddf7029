"""Framework integrations; importing this package registers the HuggingFace one.

``import flash_dmattn.integrations`` calls :func:`register` when ``transformers`` is
installed, which makes ``attn_implementation="dmattn"`` available to every transformers model
that uses the attention interface::

    import flash_dmattn.integrations  # noqa: F401  (registers "dmattn")
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="dmattn")

Without transformers the import still succeeds (the attention function works on plain
tensors); :func:`register` then raises ImportError.
"""
from __future__ import annotations

import importlib.util

from .flash_dynamic_mask_attention import flash_dynamic_mask_attention_forward
from .hf_transformers import (
    DEFAULT_NAME,
    dmattn_attention_forward,
    dmattn_mask,
    prepare_attention_call,
    register,
)

if importlib.util.find_spec("transformers") is not None:
    register()

__all__ = [
    "DEFAULT_NAME",
    "register",
    "dmattn_attention_forward",
    "dmattn_mask",
    "prepare_attention_call",
    "flash_dynamic_mask_attention_forward",
]
