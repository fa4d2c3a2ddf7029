"""Backend-neutral planning: turning masks and selections into work lists for the kernels.

The cuda, triton and flex backends import the planner; it imports no backend. Where a plan is
built on the device, its Triton kernels live beside the planner that launches them, each with a
plain-PyTorch twin that the CPU path and the tests use. Every such launch goes through
:func:`flash_dmattn.triton_launch.launch` with all of its kernel's parameters, so that a call of
shapes seen before skips Triton's per-launch argument specialisation (a plan is a dozen small
launches, host bound at the lengths the kernels are for).

* :mod:`.mask_summary` — one pass over a per-query mask: per tile, whether it is dead, full or
  partial (and, for the cuda dK/dV kernel, the mask's key bits).
* :mod:`.tiles` — per query tile, the live key tiles (full ones first), and the backward's
  transposed lists; :mod:`.tile_compact` compacts them in one kernel, :mod:`.key_mask_lists`
  builds a per-key mask's lists and each listed tile's mask bits in one kernel.
* :mod:`.gather` — per query tile, the union of its rows' live keys, for per-query masks whose
  query tiles share few keys; :mod:`.gather_verdicts` decides whether gathering beats tile
  skipping, :mod:`.gather_build` / :mod:`.gather_kernels` / :mod:`.gather_reference` build the
  plan's tensors.
* :mod:`.plain_rows` — which rows of a per-key mask the mask cuts no tile of.
* :mod:`.plan` — the backward's plan, made by the forward on the eager autograd path.
* :mod:`.rows` — per-query masks and biases with 16-byte aligned rows.
* :mod:`.decode` — decode row and split counts, and which KV-cache / paged calls the decode
  kernels take.
* :mod:`.selection` — exact top-W key selections from a per-key bias as key intervals
  (:func:`topk_intervals`), in O(L log L) and O(L) memory.
* :mod:`.key_lists` — per query tile, the position-sorted list of keys whose interval meets
  the tile, and the key blocks of the backward; shared by the forward and backward kernels.
* :mod:`.packed_intervals` — packed sequences with key intervals as one key-interval call over
  the packed tokens (their bounds moved to packed query positions).
"""
