"""The per-key mask planner (one launch) against the torch tile maps, and the forward kernel's
mask bits path, on the interpreter."""

import math

import pytest
import torch

from interpreter_only import require_triton_interpreter
from naive import assert_close

require_triton_interpreter()

from flash_dmattn.backends.triton import common  # noqa: E402
from flash_dmattn.backends.triton import forward_kernel  # noqa: E402
from flash_dmattn.planning import plain_rows  # noqa: E402
from flash_dmattn.backends.triton.forward import attention_forward  # noqa: E402
from flash_dmattn.planning.key_mask_lists import per_key_lists  # noqa: E402
from flash_dmattn.planning.tiles import build_tile_lists, per_key_lists_reference  # noqa: E402
from test_triton_kernels import naive_attention, run_case  # noqa: E402


@pytest.fixture(autouse=True)
def _poison_outputs(monkeypatch):
    monkeypatch.setattr(common, "DEBUG_POISON", True)


def _block_mask(shape, lk, density, block, gen):
    """A per-key mask mixing live blocks of ``block`` keys with scattered live keys, so one
    call has full and partial tiles (and dead ones where ``density`` is small)."""
    scattered = torch.rand(*shape, lk, generator=gen) < density
    blocks = torch.rand(*shape, -(-lk // block), generator=gen) < 0.4
    blocks[..., 0] = True  # at least one full tile
    return scattered | blocks.repeat_interleave(block, -1)[..., :lk]


def _reference_lists(mask, lq, lk, causal, bm, bn):
    return per_key_lists_reference(mask, lq, lk, causal, bm, bn, True)


def _assert_causal_forward(out, lse, q, k, v, mask):
    """A causal forward without bias (default scale) against the float64 reference."""
    ro, rl = naive_attention(q.double(), k.double(), v.double(), mask, None,
                             1 / math.sqrt(q.shape[-1]), True, 0.0)
    assert_close("out", out, ro, 2e-5)
    assert_close("lse", lse, rl, 2e-5)


def _assert_same_lists(got, ref):
    """Counts, cut counts, and entries and bits up to the count, equal."""
    idx, cnt, bits, cut = got
    ref_idx, ref_cnt, ref_bits, ref_cut = ref
    assert idx.shape == ref_idx.shape and cnt.shape == ref_cnt.shape
    assert torch.equal(cnt, ref_cnt)
    assert torch.equal(cut, ref_cut)
    used = torch.arange(idx.size(-1)) < cnt[..., :1]
    assert torch.equal(torch.where(used, idx, 0), torch.where(used, ref_idx, 0))
    assert torch.equal(torch.where(used, bits, 0), torch.where(used, ref_bits, 0))


CASES = [
    # (Bx, Hx, Lq, Lk, causal, block_m, block_n, scattered density)
    (1, 1, 100, 130, True, 16, 16, 0.05),
    (2, 3, 37, 65, True, 16, 16, 0.3),     # ragged last tile, Lq < Lk
    (2, 1, 64, 64, False, 16, 16, 0.1),    # one list row for every query tile
    (1, 2, 50, 200, True, 32, 16, 0.0),
    (1, 1, 200, 50, True, 16, 16, 0.2),    # Lq > Lk: the first query tiles see nothing
    (1, 1, 300, 1000, True, 64, 64, 0.02),  # 64-key tiles: all 64 bits of the int64
    # (Lk % 8 == 0 rows are read as int64 words of 8 mask bytes, the others byte by byte.)
    (1, 1, 129, 1025, False, 128, 64, 0.5),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "b{}h{}q{}k{}{}m{}n{}".format(
    *c[:4], "c" if c[4] else "", *c[5:7]))
def test_lists_match_torch_maps(case):
    bx, hx, lq, lk, causal, bm, bn, density = case
    gen = torch.Generator().manual_seed(lq * 7 + lk)
    mask = _block_mask((bx, hx, 1), lk, density, 32, gen)
    flag, ref_flag = torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    got = per_key_lists(mask, lq, lk, causal, bm, bn, True, flag)
    _assert_same_lists(got, per_key_lists_reference(mask, lq, lk, causal, bm, bn, True, ref_flag))
    idx, cnt, _, cut = got
    assert int(flag) == int(ref_flag) == int((cut[..., 0] > 0).any())  # raised iff a row is cut
    used = torch.arange(idx.size(-1)) < cnt[..., :1]
    flags = idx & 1
    assert (flags[used] == 1).any() and (flags[used] == 0).any()  # partial and full tiles
    # Scattered keys cut tiles; blocks of 32 keys alone cut none of 16 keys (causality and a
    # ragged end make tiles partial, not cut).
    assert bool((cut[..., 0] > 0).any()) == (density > 0)
    assert torch.equal(torch.where(used, 0, idx), torch.zeros_like(idx))  # zeros past the count


def test_broadcast_and_strided_masks():
    gen = torch.Generator().manual_seed(3)
    base = _block_mask((2, 1, 1), 90, 0.1, 16, gen)
    for mask in (base.expand(2, 3, 1, 90),                          # stride-0 heads
                 torch.ones(1, 2, 1, 1, dtype=torch.bool).expand(1, 2, 1, 90),  # key broadcast
                 _block_mask((1, 2, 1), 180, 0.1, 16, gen)[..., ::2]):         # key stride 2
        _assert_same_lists(per_key_lists(mask, 40, 90, True, 16, 16, True),
                           _reference_lists(mask, 40, 90, True, 16, 16))


def test_word_reads_only_for_aligned_rows(monkeypatch):
    # Rows of whole, 8-byte aligned words are read as int64 words; any other row byte by byte.
    # Both ways give the reference lists.
    from flash_dmattn.planning import key_mask_lists as klists

    seen = []
    real = klists._per_key_lists_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **meta):
                seen.append(meta["WORDS"])
                return real[grid](*args, **meta)
            return launch

    monkeypatch.setattr(klists, "_per_key_lists_kernel", Spy())
    base = _block_mask((1, 2, 1), 96, 0.1, 16, torch.Generator().manual_seed(4))
    for mask, words in ((base[..., :88], True), (base[..., 3:91], False), (base[..., :90], False)):
        lk = mask.size(-1)
        got = per_key_lists(mask, 40, lk, True, 16, 16, True)
        assert seen[-1] is words
        _assert_same_lists(got, _reference_lists(mask, 40, lk, True, 16, 16))


def test_build_tile_lists_uses_the_planner_for_forward_lists():
    mask = _block_mask((1, 1, 1), 70, 0.1, 16, torch.Generator().manual_seed(1))
    t = build_tile_lists(mask, 33, 70, 4, True, 16, 16, torch.device("cpu"), with_bits=True)
    assert t.fwd_bits is not None and t.fwd_bits.shape == t.fwd_idx.shape
    both = build_tile_lists(mask, 33, 70, 4, True, 16, 16, torch.device("cpu"), need_bwd=True)
    assert both.fwd_bits is None and both.bwd_idx is not None  # the torch maps serve both
    assert torch.equal(t.fwd_cnt, both.fwd_cnt)


@pytest.mark.parametrize("spec", ["BK1L", "B11L", "1H1L"])
@pytest.mark.parametrize("causal", [False, True])
def test_mixed_tiles_forward_and_backward(spec, causal):
    # Dead, full and partial tiles in one call, GQA, Lq != Lk, a -inf bias entry.
    B, H, Hkv, Lq, Lk, D = 2, 4, 2, 45, 83, 16
    dims = {"B": B, "H": H, "K": Hkv, "1": 1}
    mask = _block_mask(tuple(dims[c] for c in spec[:3]), Lk, 0.05, 16,
                       torch.Generator().manual_seed(len(spec) + causal))
    bias = torch.randn(B, Hkv, 1, Lk)
    bias[..., 5] = float("-inf")
    run_case(B, H, Hkv, Lq, Lk, D, causal=causal, mask=mask, bias=bias)


def test_forward_masks_partial_tiles_from_the_bits():
    # Lists and bits planned from mask A, the kernel given an all-True mask: the result is A's,
    # so partial tiles were masked from the bits, not from the mask tensor.
    B, H, Lq, Lk, D = 1, 2, 40, 64, 16
    a = _block_mask((B, 1, 1), Lk, 0.2, 16, torch.Generator().manual_seed(5))
    tiles = build_tile_lists(a, Lq, Lk, H, True, 16, 16, torch.device("cpu"), with_bits=True)
    assert ((tiles.fwd_idx & 1) * (torch.arange(tiles.fwd_idx.size(-1)) < tiles.fwd_cnt[..., :1])).any()
    q, k, v = (torch.randn(B, n, H, D) for n in (Lq, Lk, Lk))
    out, lse = attention_forward(q, k, v, torch.ones_like(a), None, 1 / math.sqrt(D), True, 0.0,
                                 tiles=tiles)
    _assert_causal_forward(out, lse, q, k, v, a)


# --- Uncut rows without the mask (plain_rows) ----------------------------------------------

def _mixed_cut_mask(shape, lk, gen):
    """A per-key mask whose first head is whole 16-key blocks (its rows are uncut) and whose
    other heads add scattered keys in the second half: rows that see them are cut, earlier
    causal query tiles are not."""
    blocks = torch.rand(*shape, -(-lk // 16), generator=gen) < 0.5
    blocks[..., 0] = True
    scattered = torch.rand(*shape, lk, generator=gen) < 0.3
    scattered[..., : lk // 2] = False
    scattered[:, 0] = False
    return blocks.repeat_interleave(16, -1)[..., :lk] | scattered


def _spy_row_guards(monkeypatch):
    """Per forward launch, in order: whether it was the net over cut rows."""
    guards = []
    for name in ("launch_fwd", "launch_fwd_untuned"):
        real = getattr(forward_kernel, name)

        def launch(grid, args, meta, real=real):
            guards.append(int(meta.get("CUT_ROWS", False)))
            return real(grid, args, meta)
        monkeypatch.setattr(forward_kernel, name, launch)
    return guards


@pytest.mark.parametrize("causal", [False, True])
def test_plain_rows_split_is_exact(causal, monkeypatch):
    # Every row without the mask, cut rows given no tile, then the net over the cut rows:
    # outputs and gradients as the reference (poisoned outputs; a cut row the net missed
    # keeps the zeros of the first kernel).
    monkeypatch.setattr(plain_rows, "_FORCED", True)
    guards = _spy_row_guards(monkeypatch)
    B, H, Hkv, Lq, Lk, D = 2, 4, 2, 70, 90, 16
    mask = _mixed_cut_mask((B, Hkv, 1), Lk, torch.Generator().manual_seed(11))
    cut = build_tile_lists(mask, Lq, Lk, H, causal, 16, 16, torch.device("cpu"),
                           with_bits=True).fwd_cut[..., 0]
    assert (cut == 0).any() and (cut > 0).any()  # both kinds of rows in one call
    bias = torch.randn(B, Hkv, 1, Lk)
    bias[..., 7] = float("-inf")
    run_case(B, H, Hkv, Lq, Lk, D, causal=causal, mask=mask, bias=bias)
    assert guards == [0, 1]


def test_plain_rows_follow_the_previous_alike_call(monkeypatch):
    # auto: split only when the previous call of the same shapes had no cut row -- and exact
    # when the mask changed since and now cuts some rows.
    monkeypatch.setattr(plain_rows, "VERDICTS", plain_rows.VerdictMemo())
    monkeypatch.setattr(plain_rows, "SAMPLE_EVERY", 1)
    guards = _spy_row_guards(monkeypatch)
    B, H, Lq, Lk, D = 1, 2, 48, 96, 16
    gen = torch.Generator().manual_seed(12)
    aligned = _mixed_cut_mask((B, 1, 1), Lk, gen)        # one head: whole blocks only
    mixed = _mixed_cut_mask((B, 2, 1), Lk, gen)          # a second head with cut rows
    q, k, v = (torch.randn(B, n, H, D) for n in (Lq, Lk, Lk))
    expect = [[0], [0, 1], [0], [0, 1]]
    for mask, want in zip((aligned.expand(B, 2, 1, Lk), mixed, aligned.expand(B, 2, 1, Lk),
                           aligned.expand(B, 2, 1, Lk)), expect):
        del guards[:]
        out, lse = attention_forward(q, k, v, mask, None, 1 / math.sqrt(D), True, 0.0)
        assert guards == want
        _assert_causal_forward(out, lse, q, k, v, mask)


def test_verdict_memo_is_bounded_and_never_creates_when_told_not_to():
    memo = plain_rows.VerdictMemo(max_keys=2)
    cpu = torch.device("cpu")
    assert memo.get("a", cpu, create=False) is None and len(memo) == 0
    a = memo.get("a", cpu, create=True)
    memo.get("b", cpu, create=True)
    assert memo.get("a", cpu, create=False) is a  # "a" is now the most recently used
    memo.get("c", cpu, create=True)                # drops "b"
    assert len(memo) == 2 and memo.get("b", cpu, create=False) is None
    assert memo.get("a", cpu, create=False) is a


def test_lagged_verdict_samples_the_flag_every_few_calls(monkeypatch):
    # The flag accumulates every cut raised between samples; a verdict changes only when a
    # sample is read (the call after it here, on the CPU), and a call that is not a sample
    # leaves the flag alone.
    monkeypatch.setattr(plain_rows, "SAMPLE_EVERY", 3)
    memo = plain_rows._LaggedVerdict(torch.device("cpu"))
    seen = []
    for raised in (0, 0, 1, 0, 0, 0, 0):
        memo.refresh()
        seen.append(memo.verdict)
        memo.flag.fill_(max(int(memo.flag), raised))  # this call's planner
        memo.sample()
    # Samples at calls 0, 3, 6: call 0 saw no cut; calls 1-3 raised one (call 2).
    assert seen == [None, True, True, True, False, False, False]
