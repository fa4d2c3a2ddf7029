"""The one-pass mask summary kernel vs torch block reductions, and the maps derived from it.

Runs the kernel through the Triton interpreter on CPU and compiled on a GPU (same test).
"""
import pytest
import torch

try:
    import triton  # noqa: F401
except ModuleNotFoundError as exc:
    if exc.name != "triton":
        raise
    pytest.skip("the summary kernel needs the triton package", allow_module_level=True)

from flash_dmattn.planning.gather import plan_key_gather  # noqa: E402
from flash_dmattn.planning.mask_summary import (  # noqa: E402
    key_bits_reference,
    summarize_mask,
    summary_blocks,
    wants_summary,
)
from flash_dmattn.planning.tiles import build_tile_lists, classify_tiles  # noqa: E402
from flash_dmattn.block_map import block_reduce, tile_liveness  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _masks(Lq, Lk, gen):
    """Per-query masks with dead, full and partial 16x16 tiles, in several layouts."""
    rnd = torch.rand(2, 3, Lq, Lk, generator=gen) < 0.3
    rnd[:, :, :, :16] = True                      # a full column of tiles
    rnd[:, :, :, 32:48] = False                   # a dead column of tiles
    rnd[1, 2] = False                             # one head with nothing live at all
    yield "contiguous", rnd
    yield "broadcast-batch-head", rnd[:1, :1].expand(2, 3, Lq, Lk)
    yield "non-contiguous", rnd.transpose(2, 3).contiguous().transpose(2, 3)


@pytest.mark.parametrize("Lq,Lk,block", [(63, 65, (16, 16)), (65, 129, (32, 16)), (16, 48, (16, 16)),
                                          (129, 63, (16, 64))])
def test_summary_matches_block_reductions(Lq, Lk, block):
    gen = torch.Generator().manual_seed(Lq * 1000 + Lk)
    for name, mask in _masks(Lq, Lk, gen):
        mask = mask.to(DEVICE)
        s = summarize_mask(mask, *block)
        want_any = block_reduce(mask, 2, block[0], "any")
        want_all = block_reduce(block_reduce(mask, 2, block[0], "all"), 3, block[1], "all")
        assert torch.equal(s.row_any, want_any), name
        assert torch.equal(s.tile_all, want_all), name


def _decode_key_bits(bits, Lq, Lk):
    """``(Bx, Hx, rows, width)`` bools: bit ``q % 64`` of word ``[q // 64, k]``, read back."""
    bx, hx, n_w, width = bits.shape
    shifts = torch.arange(64, device=bits.device)
    flags = (bits.unsqueeze(3) >> shifts[:, None]) & 1  # (Bx, Hx, n_w, 64, width)
    return flags.reshape(bx, hx, n_w * 64, width).bool()


@pytest.mark.parametrize("Lq,Lk,block,causal", [(63, 200, (64, 16), True), (130, 65, (64, 64), False),
                                                 (129, 129, (128, 32), True),
                                                 (65, 132, (128, 128), False),
                                                 (70, 68, (64, 16), True)])
def test_key_bits_hold_each_live_visible_element_once(Lq, Lk, block, causal):
    # Words kernel (Lk % 4 == 0, contiguous), byte kernel (odd Lk, strided); broadcast dims.
    gen = torch.Generator().manual_seed(Lq * 7 + Lk)
    for name, mask in _masks(Lq, Lk, gen):
        mask = mask.to(DEVICE)
        s = summarize_mask(mask, *block, causal=causal, key_bits=True)
        bits = s.key_bits
        assert bits.shape == (mask.size(0), mask.size(1), -(-Lq // 64), -(-Lk // 128) * 128)
        want = mask.clone()
        if causal:
            q = torch.arange(Lq, device=mask.device)[:, None]
            k = torch.arange(Lk, device=mask.device)[None, :]
            want &= k <= q + (Lk - Lq)
        got = _decode_key_bits(bits, Lq, Lk)
        assert torch.equal(got[:, :, :Lq, :Lk], want), name
        # Padding rows and keys hold no bits (the kernels read whole 128-key tiles).
        assert not got[:, :, Lq:].any() and not got[..., Lk:].any(), name
        assert torch.equal(bits, key_bits_reference(mask, causal)), name
        # The summary itself is the same with or without the bits.
        plain = summarize_mask(mask, *block, causal=causal)
        assert torch.equal(plain.row_any, s.row_any) and torch.equal(plain.tile_all, s.tile_all)


def test_key_bits_need_whole_words_of_rows():
    with pytest.raises(ValueError, match="multiples of 64"):
        summarize_mask(torch.ones(1, 1, 40, 40, dtype=torch.bool, device=DEVICE), 32, 16,
                       key_bits=True)


def test_derived_tile_maps_equal_direct_ones():
    # One summary per layout answers every coarser block shape, causal or not.
    Lq, Lk = 97, 113
    gen = torch.Generator().manual_seed(7)
    for name, mask in _masks(Lq, Lk, gen):
        mask = mask.to(DEVICE)
        s = summarize_mask(mask, 16, 16)
        for coarse in ((16, 16), (32, 16), (16, 32), (64, 48)):
            for causal in (False, True):
                live, full = classify_tiles(mask, Lq, Lk, causal, *coarse, mask.device, summary=s)
                want_live, want_full = tile_liveness(mask, Lq, Lk, *coarse, causal)
                assert torch.equal(live, want_live), (name, coarse, causal)
                assert torch.equal(full, want_full), (name, coarse, causal)
            assert torch.equal(s.row_union(coarse[0]), block_reduce(mask, 2, coarse[0], "any")), name


def test_tile_lists_and_gather_plan_identical_with_summary():
    Lq, Lk, H = 100, 90, 6
    gen = torch.Generator().manual_seed(3)
    mask = (torch.rand(1, 3, Lq, Lk, generator=gen) < 0.2).to(DEVICE)
    s = summarize_mask(mask, *summary_blocks((16, 32), (32, 16)))
    assert (s.row_block, s.key_block) == (16, 16)
    for need in ((True, False), (False, True)):
        a = build_tile_lists(mask, Lq, Lk, H, True, 32, 16, mask.device, *need)
        b = build_tile_lists(mask, Lq, Lk, H, True, 32, 16, mask.device, *need, summary=s)
        for field in ("fwd_idx", "fwd_cnt", "bwd_idx", "bwd_cnt"):
            x, y = getattr(a, field), getattr(b, field)
            assert (x is None) == (y is None)
            if x is not None:
                assert torch.equal(x, y), field
    g1 = plan_key_gather(mask, None, Lq, Lk, H, True, 32, 16, policy="always")
    g2 = plan_key_gather(mask, None, Lq, Lk, H, True, 32, 16, policy="always", summary=s)
    assert torch.equal(g1.cnt, g2.cnt)
    assert all(torch.equal(a, b) for a, b in zip(_written(g1), _written(g2)))


def test_wants_summary_only_for_per_query_masks():
    m = torch.ones(1, 1, 8, 8, dtype=torch.bool)
    assert wants_summary(m, 8, 8)
    assert not wants_summary(m[:, :, :1], 8, 8)      # per-key
    assert not wants_summary(m[:, :, :, :1], 8, 8)   # per-query scalar
    assert not wants_summary(None, 8, 8)
    assert not wants_summary(m[:, :, :1], 1, 8)     # decode row


def test_blocks_must_be_multiples():
    s = summarize_mask(torch.ones(1, 1, 32, 32, dtype=torch.bool, device=DEVICE), 16, 16)
    with pytest.raises(ValueError):
        s.tiles(24, 16)
    with pytest.raises(ValueError):
        s.row_union(8)


@pytest.mark.parametrize("causal", [False, True])
def test_flex_tile_maps_from_summary_equal_torch_reductions(causal):
    # The flex backend classifies a per-query mask with the summary kernel on CUDA; forced
    # here (the kernel runs under the interpreter on CPU).
    from flash_dmattn.backends import flex

    Lq, Lk = 300, 260  # several 128-tiles, ragged edges
    gen = torch.Generator().manual_seed(5)
    mask = (torch.rand(1, 2, Lq, Lk, generator=gen) < 0.02).to(DEVICE)
    mask[0, 0, :, :128] = True    # full tiles
    mask[0, 1, :, 128:256] = False  # dead tiles
    got = flex._tile_maps(mask, Lq, Lk, causal, mask.device, use_summary=True)
    want = tile_liveness(mask, Lq, Lk, flex.BLOCK, flex.BLOCK, causal)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert (~got[0]).any() and got[1].any()  # dead and full tiles both present


def test_aligned_rows():
    # Per-query masks with unaligned rows are copied into zero-padded 64-byte rows (same
    # values); aligned, per-key and broadcast masks are passed through untouched.
    from flash_dmattn.planning.rows import ROW_ALIGN, aligned_rows

    gen = torch.Generator().manual_seed(9)
    odd = torch.rand(2, 3, 37, 45, generator=gen) < 0.5
    got, padded = aligned_rows(odd, 37, 45)
    assert padded and torch.equal(got, odd)
    assert got.stride(2) % ROW_ALIGN == 0 and got.stride(3) == 1
    rows = got.as_strided((2, 3, 37, got.stride(2)), got.stride())
    assert not rows[..., 45:].any()  # the padding the kernels may read is False

    aligned = torch.rand(1, 2, 40, 64, generator=gen) < 0.5
    assert aligned_rows(aligned, 40, 64) == (aligned, False)
    per_key = odd[:, :, :1]
    assert aligned_rows(per_key, 37, 45) == (per_key, False)
    # a transposed (non-contiguous) mask is copied even when its sizes are multiples of 16
    t = (torch.rand(1, 1, 64, 32, generator=gen) < 0.5).transpose(2, 3)
    got, padded = aligned_rows(t, 32, 64)
    assert padded and torch.equal(got, t) and got.stride(3) == 1
    assert aligned_rows(None, 4, 4) == (None, False)


def test_aligned_rows_bias_dtypes():
    # Alignment is 16 bytes: 8 bf16 / 4 fp32 elements per row step.
    from flash_dmattn.planning.rows import aligned_rows

    b16 = torch.randn(1, 2, 9, 40).to(torch.bfloat16)   # 80-byte rows: aligned
    assert aligned_rows(b16, 9, 40) == (b16, False)
    b16_odd = torch.randn(1, 2, 9, 36).to(torch.bfloat16)  # 72-byte rows: not
    got, padded = aligned_rows(b16_odd, 9, 36)
    assert padded and torch.equal(got, b16_odd) and (got.stride(2) * 2) % 16 == 0
    b32 = torch.randn(1, 1, 5, 12, requires_grad=True)  # 48-byte rows: aligned
    assert aligned_rows(b32, 5, 12)[1] is False
    got, padded = aligned_rows(torch.randn(1, 1, 5, 13, requires_grad=True), 5, 13)
    assert padded and not got.requires_grad  # a read-only copy, outside autograd


@pytest.mark.parametrize("Lq,Lk", [(129, 63), (40, 100)])
def test_causal_summary_skips_only_invisible_tiles(Lq, Lk):
    # A causal summary leaves tiles no row can see unread (dead, not full) and agrees with the
    # full summary everywhere else, so causal tile maps built from either are identical.
    gen = torch.Generator().manual_seed(Lq + Lk)
    for name, mask in _masks(Lq, Lk, gen):
        mask = mask.to(DEVICE)
        full_s = summarize_mask(mask, 16, 16)
        causal_s = summarize_mask(mask, 16, 16, causal=True)
        q_last = torch.clamp(torch.arange(0, Lq, 16) + 16, max=Lq) - 1
        k_start = torch.arange(0, Lk, 16)
        seen = (k_start[None, :] <= (q_last + Lk - Lq)[:, None]).to(DEVICE)  # (nQ, nK)
        key_seen = seen.repeat_interleave(16, dim=1)[:, :Lk]
        assert torch.equal(causal_s.row_any, full_s.row_any & key_seen), name
        assert torch.equal(causal_s.tile_all, full_s.tile_all & seen), name
        for coarse in ((16, 16), (48, 32)):
            a = classify_tiles(mask, Lq, Lk, True, *coarse, mask.device, summary=causal_s)
            b = tile_liveness(mask, Lq, Lk, *coarse, True)
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), (name, coarse)


def _written(g):
    """A gather plan's idx and gbits with what lies past each tile's count zeroed (it is
    never written nor read)."""
    live = torch.arange(g.idx.size(-1), device=g.cnt.device) < g.cnt[..., None]
    words = (-(-g.cnt.long() // 64)).repeat_interleave(g.block_m, dim=2)[..., None]
    written = torch.arange(g.gbits.size(-1), device=g.cnt.device) < words
    return torch.where(live, g.idx, 0), torch.where(written, g.gbits, 0)


@pytest.mark.parametrize("Lq,Lk,block_m,causal", [(70, 136, 64, True), (65, 129, 128, False),
                                                   (60, 140, 128, True)])
def test_gather_bits_from_key_bits_equal_bits_from_the_mask(Lq, Lk, block_m, causal):
    # A summary with key bits makes the plan build gbits from them (a bit transpose of the
    # listed keys' words) instead of from the mask rows: the same plan, word for word, and
    # the plain PyTorch definition of that kernel agrees. Tiles with no listed key and rows
    # past Lq (60 rows in a 128-row tile) included.
    from flash_dmattn.planning.gather import KeyGather
    from flash_dmattn.planning.gather_reference import gather_key_bits_reference

    gen = torch.Generator().manual_seed(5 * Lq + Lk)
    for name, mask in list(_masks(Lq, Lk, gen))[:2]:  # the layouts matter to the summary only
        mask = mask.to(DEVICE)
        plain = summarize_mask(mask, 64, 16, causal=causal)
        with_bits = summarize_mask(mask, 64, 16, causal=causal, key_bits=True)
        want = plan_key_gather(mask, None, Lq, Lk, 6, causal, block_m, 16, policy="always",
                               summary=plain)
        got = plan_key_gather(mask, None, Lq, Lk, 6, causal, block_m, 16, policy="always",
                              summary=with_bits)
        assert torch.equal(got.cnt, want.cnt), name
        for a, b in zip(_written(got), _written(want)):
            assert torch.equal(a, b), name
        ref = gather_key_bits_reference(with_bits.key_bits, got.idx, got.cnt, Lq, block_m)
        assert torch.equal(_written(got)[1], _written(KeyGather(
            block_m, 1, got.idx, got.cnt, ref))[1]), name


def _tile_unions(mask, Lq, Lk, block_m, causal, rows_per_tile=None):
    """Bool (Bx, Hx, nQ, Lk): each query tile's live keys, cut at its causal limit (``mask``
    may also be row-block unions, ``rows_per_tile`` of them per tile)."""
    union = block_reduce(mask, 2, rows_per_tile or block_m, "any")
    if causal:
        q_last = torch.clamp(torch.arange(union.size(2)) * block_m + block_m, max=Lq) - 1
        seen = torch.arange(Lk)[None, :] <= (q_last + Lk - Lq)[:, None]
        union = union & seen.to(mask.device)
    return union


# (Lq < Lk causal is covered by test_gather_plan_kernels_match_torch_reference.)
# Few rows a case (one to six query tiles, the last one ragged): the interpreter's time grows
# with the rows, the kernels' paths do not. The bits kernel's 256-key steps (one to three) and
# its causal cut (skipped in the steps before the first row's limit) come from Lk.
@pytest.mark.parametrize("Lq,Lk,block_m,causal", [(50, 90, 32, False), (81, 63, 16, True),
                                                   (24, 300, 16, False), (38, 200, 32, True),
                                                   (20, 530, 32, True)])
def test_gather_plan_kernel_matches_torch(Lq, Lk, block_m, causal):
    # The compact-and-gather kernels against the plain PyTorch definition of idx / gbits:
    # written up to each tile's count (the kernels read no further), unions taken from a
    # summary with finer rows (two or more row blocks per tile) and from the mask itself.
    from flash_dmattn.planning.gather_reference import pack_bits_reference

    gen = torch.Generator().manual_seed(11 * Lq + Lk)
    for name, mask in _masks(Lq, Lk, gen):
        mask = mask.to(DEVICE)
        for summary in (summarize_mask(mask, 16, 16, causal=causal), None):
            g = plan_key_gather(mask, None, Lq, Lk, 6, causal, block_m, 16, policy="always",
                                summary=summary)
            if summary is None:
                union = _tile_unions(mask, Lq, Lk, block_m, causal)
            else:
                # A causal summary leaves out each row block's causally unseen key blocks, so
                # its unions may drop keys that only rows which cannot see them keep.
                union = _tile_unions(summary.row_any, Lq, Lk, block_m, causal, block_m // 16)
                assert not torch.any(union & ~_tile_unions(mask, Lq, Lk, block_m, causal))
            n_q = union.size(2)
            assert torch.equal(g.cnt, union.sum(-1, dtype=torch.int32)), name
            assert g.idx.shape == (*mask.shape[:2], n_q, Lk), name
            assert g.gbits.shape == (*mask.shape[:2], n_q * block_m, -(-Lk // 64)), name
            for b in range(mask.size(0)):
                for h in range(mask.size(1)):
                    for m in range(n_q):
                        keys = union[b, h, m].nonzero().flatten()
                        n = keys.numel()
                        assert torch.equal(g.idx[b, h, m, :n].long(), keys), (name, b, h, m)
                        rows = slice(m * block_m, min(m * block_m + block_m, Lq))
                        want = torch.zeros(block_m, max(n, 1), dtype=torch.uint8, device=DEVICE)
                        picked = mask[b, h, rows][:, keys]
                        if causal:  # and each row's own causal limit
                            row = torch.arange(rows.start, rows.stop, device=keys.device)
                            picked = picked & (keys[None, :] <= row[:, None] + Lk - Lq)
                        picked = picked.to(torch.uint8)
                        want[:picked.size(0), :n] = picked  # rows past Lq: 0
                        words = -(-n // 64)
                        got = g.gbits[b, h, m * block_m:m * block_m + block_m, :words]
                        assert torch.equal(got, pack_bits_reference(want)[:, :words]), (name, b, h, m)


def test_gather_plan_kernels_match_torch_reference():
    from flash_dmattn.planning import gather_build, gather_reference
    from flash_dmattn.planning.gather import KeyGather

    Lq, Lk, block_m = 38, 90, 16
    gen = torch.Generator().manual_seed(5)
    for name, mask in _masks(Lq, Lk, gen):
        mask = mask.to(DEVICE)
        for causal in (False, True):
            g = plan_key_gather(mask, None, Lq, Lk, 6, causal, block_m, 16, policy="always")
            union_u8, per_tile = gather_build.tile_union(mask, None, block_m)
            idx, cnt, totals = gather_reference.compact_keys_reference(
                union_u8, per_tile, Lq, Lk, causal, block_m, 16, True)
            gbits = gather_reference.gather_mask_bits_reference(
                mask.view(torch.uint8), union_u8, per_tile, Lq, block_m, causal)
            assert torch.equal(cnt, g.cnt), (name, causal)
            got_idx, got_bits = _written(g)
            assert torch.equal(got_idx, idx), (name, causal)
            assert torch.equal(got_bits, _written(KeyGather(
                block_m, 1, idx, cnt, gbits))[1]), (name, causal)
            # The totals of the auto policy, counted by the same kernel.
            _, _, got_totals = gather_build.compact_keys(union_u8, per_tile, Lq, Lk, causal,
                                                         block_m, 16, True)
            assert got_totals.tolist() == totals.tolist(), (name, causal)


def test_gather_plan_auto_policy_is_decided_on_totals(monkeypatch):
    # Under "auto" the plan is dropped exactly when prefers_tiles says so; the bits kernels
    # make the same test on the device and skip their work.
    from flash_dmattn.planning import gather_build
    from flash_dmattn.planning.gather_reference import compact_keys_reference
    from flash_dmattn.planning.gather_verdicts import prefers_tiles

    Lq = Lk = 128
    gen = torch.Generator().manual_seed(4)
    sparse = torch.zeros(1, 2, Lq, Lk, dtype=torch.bool)
    sparse[..., ::9] = True
    dense = torch.rand(1, 2, Lq, Lk, generator=gen) < 0.6
    for mask, want in ((sparse, True), (dense, False)):
        mask = mask.to(DEVICE)
        union_u8, per_tile = gather_build.tile_union(mask, None, 16)
        live, gathered = compact_keys_reference(union_u8, per_tile, Lq, Lk, True, 16, 16,
                                                True)[2].tolist()
        assert prefers_tiles(live, gathered) == (not want)
        g = plan_key_gather(mask, None, Lq, Lk, 2, True, 16, 16, policy="auto")
        assert (g is not None) == want
        # The bits kernel skips its work for a plan the totals reject (nothing written).
        totals = torch.tensor([live, gathered], dtype=torch.int32, device=DEVICE)
        sentinel = lambda shape, dtype, device: torch.full(shape, 7, dtype=dtype, device=device)
        monkeypatch.setattr(gather_build, "_empty", sentinel)
        bits = gather_build.gather_mask_bits(mask.view(torch.uint8), union_u8, per_tile, Lq, 16,
                                             True, totals)
        monkeypatch.undo()
        assert torch.all(bits == 7).item() == (not want)


@pytest.mark.parametrize("mask_heads,bias_shape", [(2, (1, 4, 1, 50)), (4, (2, 2, 1, 50)),
                                                   (1, (2, 1, 1, 50))])
def test_gather_plan_gathers_a_per_key_bias(mask_heads, bias_shape):
    # gbias[b, h, m, c] == bias[b, h, 0, idx[b, h', m, c]] with broadcast batch/head dims.
    Lq, Lk, H = 37, 50, 4
    gen = torch.Generator().manual_seed(9)
    mask = (torch.rand(2, mask_heads, Lq, Lk, generator=gen) < 0.3).to(DEVICE)
    bias = torch.randn(*bias_shape, generator=gen).to(DEVICE)
    g = plan_key_gather(mask, bias, Lq, Lk, H, True, 16, 16, policy="always")
    assert g.gbias is not None and g.gbias.shape[-1] % 64 == 0
    bg, hg = g.gbias.shape[:2]
    assert (bg, hg) == (2, max(mask_heads, bias_shape[1]))
    for b in range(bg):
        for h in range(hg):
            hm = h // (hg // mask_heads)
            hb = h // (hg // bias_shape[1])
            bb = b if bias_shape[0] > 1 else 0
            for m in range(g.cnt.size(2)):
                n = int(g.cnt[b, hm, m])
                want = bias[bb, hb, 0][g.idx[b, hm, m, :n].long()]
                end = -(-n // 64) * 64  # written: the count rounded up to 64, 0 past it
                assert torch.equal(g.gbias[b, h, m, :n], want), (b, h, m)
                assert torch.all(g.gbias[b, h, m, n:end] == 0), (b, h, m)
    from flash_dmattn.planning.gather_reference import gather_bias_reference

    ref = gather_bias_reference(bias, g.idx, g.cnt, Lk)
    hm = torch.arange(g.gbias.size(1), device=DEVICE) // (g.gbias.size(1) // mask_heads)
    ends = (-(-g.cnt.long()[:, hm] // 64) * 64).expand(*g.gbias.shape[:3])[..., None]
    written = torch.arange(ref.size(-1), device=ends.device) < ends
    assert torch.equal(torch.where(written, g.gbias, 0), ref)
    # Per-query or scalar biases are read as they are, not gathered.
    assert plan_key_gather(mask, bias[..., :1], Lq, Lk, H, True, 16, 16, "always").gbias is None


def test_word_reads_only_for_aligned_layouts():
    from flash_dmattn.planning.mask_summary import _as_words

    m = torch.zeros(2, 3, 8, 64, dtype=torch.bool)
    assert _as_words(m, 16) is not None
    assert _as_words(m[:, :1].expand(2, 3, 8, 64), 16) is not None     # broadcast heads
    assert _as_words(m[..., 4:], 16) is not None                        # starts a word later
    assert _as_words(m[..., 1:61], 16) is None                          # misaligned start
    assert _as_words(m[..., :62], 16) is None                           # Lk not a multiple of 4
    assert _as_words(m.transpose(2, 3), 16) is None                     # keys not contiguous
    assert _as_words(m, 6) is None                                      # key block not in words
    # Same summaries either way (the byte kernel on a copy that words cannot read).
    gen = torch.Generator().manual_seed(4)
    mask = (torch.rand(1, 2, 40, 96, generator=gen) < 0.3).to(DEVICE)
    by_words = summarize_mask(mask, 16, 32, causal=True)
    by_bytes = summarize_mask(mask[..., :95].contiguous(), 16, 32, causal=True)
    assert torch.equal(by_words.row_any[..., :95], by_bytes.row_any)
