"""Backend-neutral planning: turning masks and selections into work lists for the kernels.

* :mod:`.selection` — exact top-W key selections from a per-key bias as key intervals
  (:func:`topk_intervals`), in O(L log L) and O(L) memory.
* :mod:`.key_lists` — per query tile, the position-sorted list of keys whose interval meets
  the tile, and the key blocks of the backward; shared by the forward and backward kernels.
"""
