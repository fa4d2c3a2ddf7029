"""Triton kernels of the gather plan (:mod:`.gather`): each query tile's live keys compacted
into its key list, and the mask's bits (or the summary's key bits) and a per-key bias gathered
at those keys. :mod:`.gather_build` launches them; :mod:`.gather_reference` has their
plain-PyTorch twins.

Every kernel that runs after the count takes the plan's totals (``CHECK_TOTALS``) and does
nothing when they chose tile skipping, so the host need not wait for them before launching.
"""
import triton
import triton.language as tl


@triton.jit
def _tile_key_end(m, seqlen_q, seqlen_k, BLOCK_M: tl.constexpr, IS_CAUSAL: tl.constexpr):
    """One past the last key query tile ``m`` may list: its last row's bottom-right causal
    limit, or Lk."""
    key_end = seqlen_k
    if IS_CAUSAL:
        last_row = tl.minimum(m * BLOCK_M + BLOCK_M, seqlen_q) - 1
        key_end = tl.maximum(tl.minimum(last_row + (seqlen_k - seqlen_q) + 1, seqlen_k), 0)
    return key_end


@triton.jit
def _union_flags(union_rows, keys, key_end, rows_left, seqlen_k,
                 ROWS_PER_TILE: tl.constexpr):
    """int32 0/1 per key: live in one of the tile's union rows (``rows_left`` of them exist)
    and before ``key_end``. Read bounded by Lk (vector loads), then cut."""
    k_ok = keys < seqlen_k
    live = tl.load(union_rows + keys, mask=k_ok, other=0)
    for r in tl.static_range(1, ROWS_PER_TILE):
        row_ok = (keys * 0 + r) < rows_left  # a vector: the interpreter takes no scalar
        live = live | tl.load(union_rows + r * seqlen_k + keys, mask=k_ok & row_ok, other=0)
    return ((live != 0) & (keys < key_end)).to(tl.int32)


@triton.jit
def _skip_for_tiles(Totals, RATIO_NUM: tl.constexpr, RATIO_DEN: tl.constexpr):
    """Whether the plan's totals ``[live tiles, gathered tiles]`` chose tile skipping
    (:func:`.gather_verdicts.prefers_tiles` on the device)."""
    two = tl.arange(0, 2)
    tot = tl.load(Totals + two)
    live = tl.sum(tl.where(two == 0, tot, 0), 0)
    gathered = tl.sum(tl.where(two == 1, tot, 0), 0)
    return gathered * RATIO_DEN > live * RATIO_NUM


@triton.jit
def _compact_keys_kernel(
    Union, Idx, Cnt, Totals, seqlen_q, seqlen_k, n_rows, n_q,
    IS_CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, ROWS_PER_TILE: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, COUNT_TILES: tl.constexpr,
):
    """One query tile: its union's live keys (to its causal limit) in order into its idx row,
    their number into cnt; with COUNT_TILES, adds its live BLOCK_N-key tiles and its gathered
    tiles (ceil(count / BLOCK_N)) to Totals[0] and Totals[1]."""
    m = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    union_rows = Union + (bh * n_rows + m * ROWS_PER_TILE) * seqlen_k
    idx_row = Idx + (bh * n_q + m) * seqlen_k
    rows_left = n_rows - m * ROWS_PER_TILE
    key_end = _tile_key_end(m, seqlen_q, seqlen_k, BLOCK_M, IS_CAUSAL)
    base = 0
    live_tiles = 0
    for start in range(0, key_end, BLOCK_K):
        keys = start + tl.arange(0, BLOCK_K)
        live_i = _union_flags(union_rows, keys, key_end, rows_left, seqlen_k, ROWS_PER_TILE)
        tl.store(idx_row + base + tl.cumsum(live_i, 0) - 1, keys, mask=live_i != 0)
        base += tl.sum(live_i, 0)
        if COUNT_TILES:
            # Chunks start at multiples of BLOCK_K, so these are the kernels' key tiles.
            per_tile = tl.max(tl.reshape(live_i, [BLOCK_K // BLOCK_N, BLOCK_N]), 1)
            live_tiles += tl.sum(per_tile, 0)
    tl.store(Cnt + bh * n_q + m, base)
    if COUNT_TILES:
        two = tl.arange(0, 2)
        gathered = (base + BLOCK_N - 1) // BLOCK_N
        tl.atomic_add(Totals + two, tl.where(two == 0, live_tiles, gathered))


@triton.jit
def _rows_flag(flag, BLOCK_R: tl.constexpr):
    """A scalar condition as a ``[BLOCK_R]`` store mask (the interpreter takes no scalar)."""
    return (tl.zeros([BLOCK_R], dtype=tl.int32) + flag.to(tl.int32)) != 0


@triton.jit
def _load_word(union_rows, mask_rows, start, lanes, m_ok, key_end, rows_left, seqlen_k,
               stride_mn, ROWS_PER_TILE: tl.constexpr):
    """The tile's union flags (int32 0/1, see _union_flags) and the rows' mask bytes of keys
    ``start + lanes``.

    The mask is read bounded by Lk, not the causal limit: a bound the compiler knows to be a
    multiple of 16 lets it read 16-byte vectors (per-byte loads left the kernel waiting on
    memory with DRAM 10 % busy); bytes past the limit meet no live flag."""
    keys = start + lanes
    live_i = _union_flags(union_rows, keys, key_end, rows_left, seqlen_k, ROWS_PER_TILE)
    mv = tl.load(mask_rows + keys[None, :].to(tl.int64) * stride_mn,
                 mask=m_ok[:, None] & (keys < seqlen_k)[None, :], other=0)
    return live_i, mv


@triton.jit
def _cut(mv, start, lanes, row_lim):
    """Mask bytes of keys ``start + lanes`` zeroed past each row's causal limit."""
    return tl.where((start + lanes)[None, :] <= row_lim[:, None], mv, 0)


@triton.jit
def _pack_word(live_i, mv, lanes, acc, fill, word, out_rows, BLOCK_R: tl.constexpr):
    """Appends the rows' mask bits at one 64-key word's live keys to the running words
    ``acc`` (``fill`` bits in use; stored as gbits word ``word`` when full)."""
    n_live = tl.sum(live_i, 0)
    lo_half = lanes < 32
    n_lo = tl.sum(tl.where(lo_half, live_i, 0), 0)
    # Each live key's bit in its 32-key half's compressed value (32-bit math: the 64-bit
    # version issued about 25 instructions per mask byte); the mask bytes are 0 or 1, so the
    # packing is a dot product of bytes and bit values (distinct bits: the sum is their OR).
    pos = tl.cumsum(live_i, 0) - live_i - tl.where(lo_half, 0, n_lo)
    val = live_i << pos
    mb = (mv != 0).to(tl.int32)
    got_lo = tl.sum(mb * tl.where(lo_half, val, 0)[None, :], 1)
    got_hi = tl.sum(mb * tl.where(lo_half, 0, val)[None, :], 1)
    got = (got_lo.to(tl.uint32, bitcast=True).to(tl.uint64)
           | (got_hi.to(tl.uint32, bitcast=True).to(tl.uint64) << n_lo.to(tl.uint64)))
    acc = acc | (got << fill.to(tl.uint64))
    fill += n_live
    full = fill >= 64
    tl.store(out_rows + word, acc.to(tl.int64, bitcast=True), mask=_rows_flag(full, BLOCK_R))
    word += full.to(tl.int32)
    fill -= 64 * full.to(tl.int32)
    # After a store, the bits of got that did not fit: the top ``fill`` of its ``n_live``
    # (fill == 0: none, and no 64-bit shift).
    spill = got >> ((n_live - fill) & 63).to(tl.uint64)
    acc = tl.where(full, tl.where(fill > 0, spill, 0).to(tl.uint64), acc)
    return acc, fill, word


@triton.jit
def _gather_mask_bits_kernel(
    Mask, Union, GBits, Totals,
    stride_mb, stride_mh, stride_mm, stride_mn,
    num_heads_m, seqlen_q, seqlen_k, n_rows, n_q, n_words,
    IS_CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
    ROWS_PER_TILE: tl.constexpr, CHECK_TOTALS: tl.constexpr,
    RATIO_NUM: tl.constexpr, RATIO_DEN: tl.constexpr,
):
    """``BLOCK_R`` gbits rows: each row's mask bits at the union's keys, packed in order.

    Per 64-key word: the union's flags give each live key its position among the word's live
    keys (an exclusive prefix count); each row's bits land there in one 64-bit value, which is
    appended to the row's running word ``acc`` at bit ``fill``; a full word is stored and its
    overflow starts the next one. No branches: with the mask load behind a branch on the
    word's live count, every word waited for two memory latencies.
    Words past the tile's count are not written. CHECK_TOTALS: nothing is done when the
    plan's totals chose tile skipping.
    """
    SPLITS: tl.constexpr = BLOCK_M // BLOCK_R
    m = tl.program_id(0) // SPLITS
    part = tl.program_id(0) % SPLITS
    bh = tl.program_id(1)
    b = (bh // num_heads_m).to(tl.int64)
    h = (bh % num_heads_m).to(tl.int64)
    union_rows = Union + (bh.to(tl.int64) * n_rows + m * ROWS_PER_TILE) * seqlen_k
    rows_left = n_rows - m * ROWS_PER_TILE
    key_end = _tile_key_end(m, seqlen_q, seqlen_k, BLOCK_M, IS_CAUSAL)
    if CHECK_TOTALS:
        key_end = tl.where(_skip_for_tiles(Totals, RATIO_NUM, RATIO_DEN), 0, key_end)
    in_tile = part * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_m = m * BLOCK_M + in_tile
    m_ok = offs_m < seqlen_q
    row_lim = offs_m + (seqlen_k - seqlen_q)  # bottom-right causal: the last key a row sees
    first_lim = m * BLOCK_M + part * BLOCK_R + (seqlen_k - seqlen_q)  # the smallest of them
    mask_rows = Mask + b * stride_mb + h * stride_mh + offs_m[:, None].to(tl.int64) * stride_mm
    out_rows = GBits + ((bh.to(tl.int64) * n_q + m) * BLOCK_M + in_tile) * n_words
    lanes = tl.arange(0, 64)
    acc = tl.zeros([BLOCK_R], dtype=tl.uint64)
    fill = tl.zeros([], dtype=tl.int32)  # bits of acc in use, 0..63
    word = tl.zeros([], dtype=tl.int32)  # the gbits word acc becomes
    # Four 64-key words a step, all loaded before any is packed: the loads of one step are
    # then in flight together (one word a step waits on memory).
    for start in range(0, key_end, 256):
        u0, m0 = _load_word(union_rows, mask_rows, start, lanes, m_ok, key_end, rows_left,
                            seqlen_k, stride_mn, ROWS_PER_TILE)
        u1, m1 = _load_word(union_rows, mask_rows, start + 64, lanes, m_ok, key_end, rows_left,
                            seqlen_k, stride_mn, ROWS_PER_TILE)
        u2, m2 = _load_word(union_rows, mask_rows, start + 128, lanes, m_ok, key_end, rows_left,
                            seqlen_k, stride_mn, ROWS_PER_TILE)
        u3, m3 = _load_word(union_rows, mask_rows, start + 192, lanes, m_ok, key_end, rows_left,
                            seqlen_k, stride_mn, ROWS_PER_TILE)
        if IS_CAUSAL:
            # Each row's bytes past its own causal limit read as 0, so the gathered kernels
            # need no causal test; only steps reaching past the first row's limit need the
            # cut (in every step it would cost a noticeable share of the kernel).
            if start + 255 > first_lim:
                m0 = _cut(m0, start, lanes, row_lim)
                m1 = _cut(m1, start + 64, lanes, row_lim)
                m2 = _cut(m2, start + 128, lanes, row_lim)
                m3 = _cut(m3, start + 192, lanes, row_lim)
        acc, fill, word = _pack_word(u0, m0, lanes, acc, fill, word, out_rows, BLOCK_R)
        acc, fill, word = _pack_word(u1, m1, lanes, acc, fill, word, out_rows, BLOCK_R)
        acc, fill, word = _pack_word(u2, m2, lanes, acc, fill, word, out_rows, BLOCK_R)
        acc, fill, word = _pack_word(u3, m3, lanes, acc, fill, word, out_rows, BLOCK_R)
    tl.store(out_rows + word, acc.to(tl.int64, bitcast=True), mask=_rows_flag(fill > 0, BLOCK_R))


@triton.jit
def _gather_key_bits_kernel(
    KeyBits, Idx, Cnt, GBits, Totals,
    stride_kb, stride_kh, stride_kw,
    num_heads_m, n_bit_rows, n_q, n_words, width,
    BLOCK_M: tl.constexpr, CHUNKS: tl.constexpr, CHECK_TOTALS: tl.constexpr,
    RATIO_NUM: tl.constexpr, RATIO_DEN: tl.constexpr,
):
    """64 gbits rows x CHUNKS words: the listed keys' key-bit words of the rows' 64-query
    word, transposed. 32-bit math on the words' halves (rows 0-31 read the low half, 32-63
    the high one), each output word packed as two 32-key halves (distinct bits: sums)."""
    HALVES: tl.constexpr = BLOCK_M // 64
    m = tl.program_id(0) // HALVES
    qw = tl.program_id(0)  # the rows' key-bits word row: m * HALVES + half
    bh = tl.program_id(2)
    b = (bh // num_heads_m).to(tl.int64)
    h = (bh % num_heads_m).to(tl.int64)
    cnt = tl.load(Cnt + bh.to(tl.int64) * n_q + m)
    if CHECK_TOTALS:
        cnt = tl.where(_skip_for_tiles(Totals, RATIO_NUM, RATIO_DEN), 0, cnt)
    word0 = tl.program_id(1) * CHUNKS
    if word0 * 64 < cnt:
        cols = word0 * 64 + tl.arange(0, CHUNKS * 64)
        ok = cols < cnt
        keys = tl.load(Idx + (bh.to(tl.int64) * n_q + m) * width + cols, mask=ok, other=0)
        kw = tl.load(KeyBits + b * stride_kb + h * stride_kh + qw.to(tl.int64) * stride_kw + keys,
                     mask=ok & ((cols * 0 + qw) < n_bit_rows), other=0)  # vector: interpreter
        lo = kw.to(tl.int32)  # the low 32 bits (truncation)
        hi = (kw >> 32).to(tl.int32)
        rows = tl.arange(0, 64)
        half_word = tl.where((rows < 32)[:, None], lo[None, :], hi[None, :])
        bit = (half_word >> (rows % 32)[:, None]) & 1  # (64 rows, CHUNKS * 64 keys)
        lane = tl.arange(0, CHUNKS * 64) % 64
        val = bit << (lane % 32)[None, :]
        val3 = tl.reshape(val, (64, CHUNKS, 64))
        low_keys = (tl.arange(0, 64) < 32)[None, None, :]
        got_lo = tl.sum(tl.where(low_keys, val3, 0), 2)
        got_hi = tl.sum(tl.where(low_keys, 0, val3), 2)
        word = (got_lo.to(tl.uint32, bitcast=True).to(tl.uint64)
                | (got_hi.to(tl.uint32, bitcast=True).to(tl.uint64) << 32))
        out_words = word0 + tl.arange(0, CHUNKS)
        out_rows = (bh.to(tl.int64) * n_q * BLOCK_M + qw * 64 + rows) * n_words
        tl.store(GBits + out_rows[:, None] + out_words[None, :], word.to(tl.int64, bitcast=True),
                 mask=(out_words * 64 < cnt)[None, :])


@triton.jit
def _gather_bias_kernel(
    Bias, Idx, Cnt, GBias, Totals,
    stride_bb, stride_bh, stride_bk,
    stride_ib, stride_ih, stride_im, stride_cb, stride_ch,
    num_heads_g, head_div_m, head_div_b, width, n_q,
    BLOCK_C: tl.constexpr, ALIGN: tl.constexpr, CHECK_TOTALS: tl.constexpr,
    RATIO_NUM: tl.constexpr, RATIO_DEN: tl.constexpr,
):
    """One gbias row (see :func:`.gather_build.gather_bias`) per program: bias values at the
    tile's keys, 0 from its count to the next multiple of ALIGN."""
    m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // num_heads_g).to(tl.int64)
    h = bh % num_heads_g
    hm = (h // head_div_m).to(tl.int64)
    idx_row = Idx + b * stride_ib + hm * stride_ih + m * stride_im
    count = tl.load(Cnt + b * stride_cb + hm * stride_ch + m)
    bias_row = Bias + b * stride_bb + (h // head_div_b).to(tl.int64) * stride_bh
    out_row = GBias + (bh.to(tl.int64) * n_q + m) * width
    end = (count + ALIGN - 1) // ALIGN * ALIGN
    if CHECK_TOTALS:
        end = tl.where(_skip_for_tiles(Totals, RATIO_NUM, RATIO_DEN), 0, end)
    for start in range(0, end, BLOCK_C):
        cols = start + tl.arange(0, BLOCK_C)
        used = cols < count
        keys = tl.load(idx_row + cols, mask=used, other=0)
        vals = tl.load(bias_row + keys.to(tl.int64) * stride_bk, mask=used, other=0.0)
        tl.store(out_row + cols, vals, mask=cols < end)
