"""The one-launch tile-list compaction against its plain-PyTorch version (interpreter)."""

import pytest
import torch

from interpreter_only import require_triton_interpreter

require_triton_interpreter()

from flash_dmattn.planning.tile_compact import compact_tiles  # noqa: E402
from flash_dmattn.planning.tiles import compact_reference  # noqa: E402


def _check(live, partial):
    idx, cnt = compact_tiles(live, partial)
    ref_idx, ref_cnt = compact_reference(live, partial)
    assert idx.dtype == cnt.dtype == torch.int32 and idx.is_contiguous() and cnt.is_contiguous()
    assert idx.shape == live.shape and cnt.shape == live.shape[:3] + (2,)
    assert torch.equal(cnt, ref_cnt)
    n_live = cnt[..., 0]
    pos = torch.arange(live.size(-1))
    used = pos < n_live[..., None]
    assert torch.equal(torch.where(used, idx, 0), torch.where(used, ref_idx, 0))
    assert torch.equal(torch.where(used, 0, idx), torch.zeros_like(idx))  # zeros past the count


@pytest.mark.parametrize("n", [1, 15, 16, 37])
def test_compact_matches_reference(n):
    g = torch.Generator().manual_seed(n)
    live = torch.rand(2, 3, 5, n, generator=g) < 0.6
    partial = live & (torch.rand(2, 3, 5, n, generator=g) < 0.5)
    _check(live, partial)


def test_compact_broadcast_and_transposed_views():
    g = torch.Generator().manual_seed(7)
    live = (torch.rand(1, 2, 1, 21, generator=g) < 0.5).expand(1, 2, 6, 21)  # stride-0 rows
    partial = live & (torch.rand(1, 2, 6, 21, generator=g) < 0.3)
    _check(live, partial)
    _check(live.transpose(2, 3), partial.transpose(2, 3))  # the backward's lists
    none = torch.zeros(1, 1, 3, 9, dtype=torch.bool)
    _check(none, none)
