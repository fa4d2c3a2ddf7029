"""What every backend is: a name, an availability probe, capability checks and two entry points."""
from __future__ import annotations

import abc
from typing import List, Optional

from ..inputs import AttentionInputs, VarlenInputs
from ..registry import BackendDeclined  # noqa: F401  (defined beside the dispatch that catches it)


class Backend(abc.ABC):
    """One implementation of the flash_dmattn contract.

    Subclasses set ``name`` and implement :meth:`probe` (is the software there?),
    :meth:`not_supported_reasons` (can it run these inputs?) and :meth:`attention`.
    ``attention`` receives validated inputs and returns what the public function returns:
    ``out`` or, with ``return_attn_probs``, ``(out, lse, attn_probs)``.
    """

    name: str = ""

    def __init__(self) -> None:
        self._probed = False
        self._unavailable: Optional[str] = None

    # Availability -------------------------------------------------------------------------
    @abc.abstractmethod
    def probe(self) -> Optional[str]:
        """Return None when usable in this environment, else the reason it is not.

        Called once, lazily (never at import time), so it may import optional packages.
        It must not initialise a GPU context unless the backend needs a GPU anyway.
        """

    def unavailable_reason(self) -> Optional[str]:
        if not self._probed:
            try:
                self._unavailable = self.probe()
            except Exception as exc:  # a broken optional install must not break import
                self._unavailable = f"probe failed: {type(exc).__name__}: {exc}"
            self._probed = True
        return self._unavailable

    @property
    def available(self) -> bool:
        return self.unavailable_reason() is None

    def version(self) -> str:
        return "-"

    # Capabilities -------------------------------------------------------------------------
    @abc.abstractmethod
    def not_supported_reasons(self, inputs: AttentionInputs) -> List[str]:
        """Why this backend cannot compute these inputs exactly (empty list = it can)."""

    def auto_skip_reasons(self, inputs: AttentionInputs) -> List[str]:
        """Why auto-dispatch ranks this backend after the ones it prefers for ``inputs``
        (empty: it is among them). The preference is :mod:`flash_dmattn.policy`'s table, not
        the backend's; explicitly requested backends ignore it."""
        from ..policy import passed_over_reasons

        return passed_over_reasons(self.name, inputs)

    def varlen_not_supported_reasons(self, inputs: VarlenInputs) -> List[str]:
        return [f"{self.name} has no varlen (packed sequences) path"]

    # Entry points -------------------------------------------------------------------------
    @abc.abstractmethod
    def attention(self, inputs: AttentionInputs):
        """Compute attention for validated inputs."""

    def varlen_attention(self, inputs: VarlenInputs):
        raise RuntimeError(f"backend {self.name!r} has no varlen path")

    @staticmethod
    def plain_attention(query, key, value, softmax_scale, is_causal, seqlen_q, seqlen_k):
        """A plain call without :class:`AttentionInputs` (:func:`flash_dmattn.registry.run_plain`:
        no mask, bias, soft cap, KV cache, dropout or probabilities; the tensors as the user
        gave them, in a signature that passed validation; ``softmax_scale`` None or a finite
        float, ``is_causal`` a bool). Returns what :meth:`attention` would, or None to have
        the call validated and run through :meth:`attention`: the default. A subclass may
        define it as a method or, as here, a static function. Asked for CPU tensors only."""
        return None

    @staticmethod
    def plain_cuda_attention(query, key, value, softmax_scale, is_causal, seqlen_q, seqlen_k):
        """:meth:`plain_attention` for CUDA tensors (all three on one device): what
        :meth:`attention` would return, or None (the default) to have the call validated and
        run through :meth:`attention`."""
        return None
