"""The producer warpgroup of the MODEL1 Hopper decode kernel (sm90_model1.py): it gathers each
block of 64 keys of the joined index list (main cache, then extra cache) and writes them into a
shared stage as bf16 K = float(e4m3) * 2^(b - 127) per 64-wide tile (exact, sm90_model1.py's
docstring), the rope as it is, and each key's validity; then arrives on the stage's `full` barrier.

Two producers with the same stages and hand-overs:
- `producer` (at 128 heads, two of them, PART 0 and 1): keys [32 PART, 32 PART + 32) of each block:
  their slot numbers, then all their bytes (16-byte loads into registers), then the stage wait, the
  conversion and the stores; each arrives on `full` (count 2). Two partitions of half a block
  convert a block in about half the time one partition takes for all of it (the conversion's
  issue slots bound 128 heads, where two programs per token each convert every key);
- `producer_roll` (at <= 64 heads, `sm90_model1.roll`): the record as int32 words in two halves,
  each half's gathers in flight while the other half of the previous block converts.
"""
from __future__ import annotations

from openmla.kernels.sparse_mla_decode import sm90 as _v32
from openmla.quant import ue8m0 as _ue8m0

if _v32._GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia import hopper
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier

    _ue8m0_to_f32 = gluon.jit(_ue8m0.ue8m0_to_f32.fn)
    _fp8_to_f16 = _v32._fp8_to_f16

    @gluon.jit
    def _dequant(x, sb):
        # e4m3 bytes [N, TILE] times 2^(sb - 127) per row -> bf16, exact (sm90_model1.py's docstring)
        return (_fp8_to_f16(x).to(gl.float32) * _ue8m0_to_f32(sb)[:, None]).to(gl.bfloat16)

    @gluon.jit
    def _list_pos(i, nm, p_idx, p_xidx, k_lo, m_hi, x_lo, x_hi, HAS_EXTRA: gl.constexpr, BLOCK_N: gl.constexpr):
        # block i of this split: the main list's blocks first, then the extra list's (selects, not
        # branches: an int argument equal to 1 arrives as a constant); the address of its first
        # index and how many of its positions are in the list (<= 0 past the last block)
        p_i = p_idx + k_lo + i * BLOCK_N
        n_in = m_hi - k_lo - i * BLOCK_N
        if HAS_EXTRA:
            is_x = i >= nm
            j = i - nm
            p_i = gl.where(is_x, p_xidx + x_lo + j * BLOCK_N, p_i)
            n_in = gl.where(is_x, x_hi - x_lo - j * BLOCK_N, n_in)
        return p_i, n_in

    @gluon.jit
    def _geo(i, nm, cache_ptr, xcache_ptr, num_slots, block_size, stride_cb, x_num_slots, x_block_size,
             stride_xb, HAS_EXTRA: gl.constexpr):
        # block i's cache: base, slots, page size, page stride
        c_ptr = cache_ptr
        slots = num_slots
        bs = block_size
        scb = stride_cb
        if HAS_EXTRA:
            is_x = i >= nm
            c_ptr = gl.where(is_x, xcache_ptr, c_ptr)
            slots = gl.where(is_x, x_num_slots, slots)
            bs = gl.where(is_x, x_block_size, bs)
            scb = gl.where(is_x, stride_xb, scb)
        return c_ptr, slots, bs, scb

    @gluon.jit
    def _rec(b_idx, c_ptr, slots, bs, scb):
        # each slot's page base (64-bit: a cache may pass 2 GB), position in the page and validity
        # (an invalid slot reads slot 0's address, masked)
        m = (b_idx >= 0) & (b_idx < slots)
        b_idx = gl.where(m, b_idx, 0)
        blk = c_ptr + (b_idx // bs).to(gl.int64) * scb
        tok = (b_idx % bs).to(gl.int64)
        return blk, tok, m

    @gluon.jit
    def _rows(p_i, n_in, c_ptr, slots, bs, scb, o_n):
        # the block's slots (positions >= n_in are not in the list) in o_n's layout, then _rec
        b_idx = gl.load(p_i + o_n, mask=o_n < n_in, other=-1)
        return _rec(b_idx, c_ptr, slots, bs, scb)

    @gluon.jit
    def producer(cache_ptr, p_idx, xcache_ptr, p_xidx, k_lo, m_hi, nm, x_lo, x_hi, n_blk,
                 num_slots, block_size, stride_cb, x_num_slots, x_block_size, stride_xb,
                 s_k, s_ok, full, empty, HAS_EXTRA: gl.constexpr, BLOCK_N: gl.constexpr,
                 TILE: gl.constexpr, NT: gl.constexpr, ROPE: gl.constexpr, REC: gl.constexpr, ROPE_OFF: gl.constexpr,
                 SCALE_BYTES: gl.constexpr, PART: gl.constexpr):
        HB: gl.constexpr = BLOCK_N // 2  # this partition's keys of a block: [PART * HB, PART * HB + HB)
        GB: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])  # [keys, 64 bytes]
        GR: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])  # [keys, 64 bf16]
        GS: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        o_nb = gl.arange(0, HB, layout=gl.SliceLayout(1, GB))
        o_nr = gl.arange(0, HB, layout=gl.SliceLayout(1, GR))
        o_ns = gl.arange(0, HB, layout=GS)
        o_b = gl.arange(0, TILE, layout=gl.SliceLayout(0, GB))
        o_r = gl.arange(0, ROPE, layout=gl.SliceLayout(0, GR))
        for i in range(n_blk):
            buf = i % 2
            p_i, n_in = _list_pos(i, nm, p_idx, p_xidx, k_lo, m_hi, x_lo, x_hi, HAS_EXTRA, BLOCK_N)
            p_i = p_i + PART * HB
            n_in = n_in - PART * HB
            c_ptr, slots, bs, scb = _geo(i, nm, cache_ptr, xcache_ptr, num_slots, block_size, stride_cb,
                                         x_num_slots, x_block_size, stride_xb, HAS_EXTRA)
            # the row numbers once in each load layout (cheaper than converting them: sm90.py)
            blk_b, tok_b, m_b = _rows(p_i, n_in, c_ptr, slots, bs, scb, o_nb)
            blk_r, tok_r, m_r = _rows(p_i, n_in, c_ptr, slots, bs, scb, o_nr)
            _, _, m_s = _rows(p_i, n_in, c_ptr, slots, bs, scb, o_ns)
            p_b = gl.multiple_of(blk_b + tok_b * REC, 16)
            p_b = p_b[:, None] + o_b[None, :]
            x0 = gl.load(p_b + 0 * TILE, mask=m_b[:, None], other=0)
            x1 = gl.load(p_b + 1 * TILE, mask=m_b[:, None], other=0)
            x2 = gl.load(p_b + 2 * TILE, mask=m_b[:, None], other=0)
            x3 = gl.load(p_b + 3 * TILE, mask=m_b[:, None], other=0)
            x4 = gl.load(p_b + 4 * TILE, mask=m_b[:, None], other=0)
            x5 = gl.load(p_b + 5 * TILE, mask=m_b[:, None], other=0)
            x6 = gl.load(p_b + 6 * TILE, mask=m_b[:, None], other=0)
            p_r = gl.multiple_of((blk_r + tok_r * REC + ROPE_OFF).to(gl.pointer_type(gl.bfloat16)), 16)
            xr = gl.load(p_r[:, None] + o_r[None, :], mask=m_r[:, None], other=0.0)
            # a token's scale bytes follow the block's records; unread (masked) bytes are 0 = 2^-127
            p_s = blk_b + bs * REC + tok_b * SCALE_BYTES
            s0 = gl.load(p_s + 0, mask=m_b, other=0)
            s1 = gl.load(p_s + 1, mask=m_b, other=0)
            s2 = gl.load(p_s + 2, mask=m_b, other=0)
            s3 = gl.load(p_s + 3, mask=m_b, other=0)
            s4 = gl.load(p_s + 4, mask=m_b, other=0)
            s5 = gl.load(p_s + 5, mask=m_b, other=0)
            s6 = gl.load(p_s + 6, mask=m_b, other=0)
            mbarrier.wait(empty.index(buf), ((i // 2) & 1) ^ 1)
            sk = s_k.index(buf).slice(PART * HB, HB, dim=0)
            sk.slice(0 * TILE, TILE, dim=1).store(_dequant(x0, s0))
            sk.slice(1 * TILE, TILE, dim=1).store(_dequant(x1, s1))
            sk.slice(2 * TILE, TILE, dim=1).store(_dequant(x2, s2))
            sk.slice(3 * TILE, TILE, dim=1).store(_dequant(x3, s3))
            sk.slice(4 * TILE, TILE, dim=1).store(_dequant(x4, s4))
            sk.slice(5 * TILE, TILE, dim=1).store(_dequant(x5, s5))
            sk.slice(6 * TILE, TILE, dim=1).store(_dequant(x6, s6))
            sk.slice(NT * TILE, ROPE, dim=1).store(xr)
            s_ok.index(buf).slice(PART * HB, HB).store(m_s.to(gl.int8))
            hopper.fence_async_shared()
            mbarrier.arrive(full.index(buf))

    @gluon.jit
    def _cvt_words(w, sc):
        # int32 words of four e4m3 bytes and an fp32 scale -> two int32 words of bf16 pairs (bytes
        # 0-1 and 2-3), each float(e4m3) * sc rounded once: _dequant's values, bit for bit
        return gl.inline_asm_elementwise(
            """{ .reg .b16 l, h; .reg .b32 a, b; .reg .f16 x0, x1, x2, x3; .reg .f32 f0, f1, f2, f3;
            mov.b32 {l, h}, $2;
            cvt.rn.f16x2.e4m3x2 a, l; cvt.rn.f16x2.e4m3x2 b, h;
            mov.b32 {x0, x1}, a; mov.b32 {x2, x3}, b;
            cvt.f32.f16 f0, x0; cvt.f32.f16 f1, x1; cvt.f32.f16 f2, x2; cvt.f32.f16 f3, x3;
            mul.f32 f0, f0, $3; mul.f32 f1, f1, $3; mul.f32 f2, f2, $3; mul.f32 f3, f3, $3;
            cvt.rn.bf16x2.f32 $0, f1, f0; cvt.rn.bf16x2.f32 $1, f3, f2; }""",
            "=r,=r,r,r", [w, sc], dtype=(gl.int32, gl.int32), is_pure=True, pack=1)

    @gluon.jit
    def _put_tile(s32, w, sw, T: gl.constexpr, WT: gl.constexpr):
        # e4m3 tile T of a block (words [keys, WT]) into the stage's int32 view (2 * WT words a
        # tile), scaled by byte T % 4 of each key's scale word sw
        sc = _ue8m0_to_f32((sw >> (8 * (T % 4))) & 0xFF)
        lo, hi = _cvt_words(w, sc[:, None])
        s32.slice(T * 2 * WT, 2 * WT, dim=1).store(gl.join(lo, hi).reshape([w.shape[0], 2 * WT]))

    @gluon.jit
    def _slots(i, nm, p_idx, p_xidx, k_lo, m_hi, x_lo, x_hi, o_nw, o_ns, HAS_EXTRA: gl.constexpr,
               BLOCK_N: gl.constexpr):
        # block i's slot numbers in the row layout of the word loads and one a thread (validity);
        # -1 where a position is not in the list
        p_i, n_in = _list_pos(i, nm, p_idx, p_xidx, k_lo, m_hi, x_lo, x_hi, HAS_EXTRA, BLOCK_N)
        return (gl.load(p_i + o_nw, mask=o_nw < n_in, other=-1),
                gl.load(p_i + o_ns, mask=o_ns < n_in, other=-1))

    @gluon.jit
    def _first_half(i, iw, nm, cache_ptr, xcache_ptr, num_slots, block_size, stride_cb, x_num_slots,
                    x_block_size, stride_xb, o_w, HAS_EXTRA: gl.constexpr, REC: gl.constexpr,
                    SCALE_BYTES: gl.constexpr, WT: gl.constexpr):
        # block i's pieces 0-3 and its keys' two scale words (iw: its slot numbers), issued and
        # not waited for; and the slot count of its cache
        c_ptr, slots, bs, scb = _geo(i, nm, cache_ptr, xcache_ptr, num_slots, block_size, stride_cb,
                                     x_num_slots, x_block_size, stride_xb, HAS_EXTRA)
        blk, tok, m_w = _rec(iw, c_ptr, slots, bs, scb)
        p_w = (gl.multiple_of(blk + tok * REC, 16).to(gl.pointer_type(gl.int32)))[:, None] + o_w[None, :]
        p_sw = (blk + bs * REC + tok * SCALE_BYTES).to(gl.pointer_type(gl.int32))
        a0 = gl.load(p_w + 0 * WT, mask=m_w[:, None], other=0)
        a1 = gl.load(p_w + 1 * WT, mask=m_w[:, None], other=0)
        a2 = gl.load(p_w + 2 * WT, mask=m_w[:, None], other=0)
        a3 = gl.load(p_w + 3 * WT, mask=m_w[:, None], other=0)
        sw0 = gl.load(p_sw, mask=m_w, other=0)
        sw1 = gl.load(p_sw + 1, mask=m_w, other=0)
        return a0, a1, a2, a3, sw0, sw1, slots

    @gluon.jit
    def producer_roll(cache_ptr, p_idx, xcache_ptr, p_xidx, k_lo, m_hi, nm, x_lo, x_hi, n_blk,
                      num_slots, block_size, stride_cb, x_num_slots, x_block_size, stride_xb,
                      s_k, s_ok, full, empty, HAS_EXTRA: gl.constexpr, BLOCK_N: gl.constexpr,
                      TILE: gl.constexpr, NT: gl.constexpr, ROPE: gl.constexpr, REC: gl.constexpr,
                      ROPE_OFF: gl.constexpr, SCALE_BYTES: gl.constexpr):
        # `producer`'s stages with each gather in flight while half a block converts (`roll`): a
        # record is 9 pieces of 64 bytes, loaded as int32 words (a loop-carried byte tensor would
        # take a register a byte): e4m3 tiles 0-6, then the rope's two halves (stored as they are).
        # Iteration i loads block i's pieces 4-8, waits for the stage, converts pieces 0-3 (loaded
        # in iteration i - 1), loads block i + 1's pieces 0-3 and scale words, converts and stores
        # pieces 4-8, hands the stage over, and loads block i + 2's slot numbers. Loads past the
        # last block are masked off (no positions in the list).
        # (the rope's 2 * ROPE bytes are the last two pieces of TILE bytes)
        gl.static_assert((NT == 7) & (SCALE_BYTES == 8) & (ROPE_OFF == NT * TILE) & (2 * ROPE == 2 * TILE))
        GW: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [4, 1], [1, 0])  # [keys, 16 words]
        GS: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        SW32: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)
        WT: gl.constexpr = TILE // 4
        o_nw = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, GW))
        o_ns = gl.arange(0, BLOCK_N, layout=GS)
        o_w = gl.arange(0, WT, layout=gl.SliceLayout(0, GW))
        # the stages' bytes as words: the 128-byte swizzle moves 16-byte pieces, whatever the type
        s32 = s_k._reinterpret(gl.int32, [2, BLOCK_N, (NT * TILE + ROPE) // 2], SW32)
        # block 0's slot numbers, pieces 0-3 and scale words; block 1's slot numbers
        iw, i_s = _slots(0, nm, p_idx, p_xidx, k_lo, m_hi, x_lo, x_hi, o_nw, o_ns, HAS_EXTRA, BLOCK_N)
        a0, a1, a2, a3, sw0, sw1, slots = _first_half(0, iw, nm, cache_ptr, xcache_ptr, num_slots, block_size,
                                                      stride_cb, x_num_slots, x_block_size, stride_xb, o_w,
                                                      HAS_EXTRA, REC, SCALE_BYTES, WT)
        m_s = (i_s >= 0) & (i_s < slots)
        jw, js = _slots(1, nm, p_idx, p_xidx, k_lo, m_hi, x_lo, x_hi, o_nw, o_ns, HAS_EXTRA, BLOCK_N)
        for i in range(n_blk):
            buf = i % 2
            c_ptr, slots, bs, scb = _geo(i, nm, cache_ptr, xcache_ptr, num_slots, block_size, stride_cb,
                                         x_num_slots, x_block_size, stride_xb, HAS_EXTRA)
            blk, tok, m_w = _rec(iw, c_ptr, slots, bs, scb)
            p_w = (gl.multiple_of(blk + tok * REC, 16).to(gl.pointer_type(gl.int32)))[:, None] + o_w[None, :]
            a4 = gl.load(p_w + 4 * WT, mask=m_w[:, None], other=0)
            a5 = gl.load(p_w + 5 * WT, mask=m_w[:, None], other=0)
            a6 = gl.load(p_w + 6 * WT, mask=m_w[:, None], other=0)
            a7 = gl.load(p_w + 7 * WT, mask=m_w[:, None], other=0)
            a8 = gl.load(p_w + 8 * WT, mask=m_w[:, None], other=0)
            mbarrier.wait(empty.index(buf), ((i // 2) & 1) ^ 1)
            sk = s32.index(buf)
            _put_tile(sk, a0, sw0, 0, WT)
            _put_tile(sk, a1, sw0, 1, WT)
            _put_tile(sk, a2, sw0, 2, WT)
            _put_tile(sk, a3, sw0, 3, WT)
            a0, a1, a2, a3, tw0, tw1, slots = _first_half(i + 1, jw, nm, cache_ptr, xcache_ptr, num_slots,
                                                          block_size, stride_cb, x_num_slots, x_block_size,
                                                          stride_xb, o_w, HAS_EXTRA, REC, SCALE_BYTES, WT)
            m_n = (js >= 0) & (js < slots)
            _put_tile(sk, a4, sw1, 4, WT)
            _put_tile(sk, a5, sw1, 5, WT)
            _put_tile(sk, a6, sw1, 6, WT)
            sk.slice(NT * 2 * WT, WT, dim=1).store(a7)
            sk.slice(NT * 2 * WT + WT, WT, dim=1).store(a8)
            s_ok.index(buf).store(m_s.to(gl.int8))
            hopper.fence_async_shared()
            mbarrier.arrive(full.index(buf))
            sw0 = tw0
            sw1 = tw1
            m_s = m_n
            iw = jw
            jw, js = _slots(i + 2, nm, p_idx, p_xidx, k_lo, m_hi, x_lo, x_hi, o_nw, o_ns, HAS_EXTRA, BLOCK_N)
