"""FlashAttention backward for Hopper (sm90), FA3-style, written in Gluon: five products.

One program holds a K/V tile of ``BLOCK_N = 64 * CONSUMERS`` keys of one KV head and walks
every query tile that can see it (for GQA, of every query head of the group, in order):

- a **producer** partition loads the K/V tile once and streams Q and dO
  tiles of ``BLOCK_M`` rows through a ring of ``STAGES`` shared-memory buffers with TMA,
  each guarded by a full/empty mbarrier pair;
- **consumer** warpgroups, one per 64 keys, work in the transposed orientation (rows are
  keys, columns queries), so P and dS come out of the tensor cores already as the left
  operands of dV and dK and stay in registers:

      Sᵀ = K·Qᵀ,  dPᵀ = V·dOᵀ,  Pᵀ = exp2(Sᵀ·scale - LSE),  dSᵀ = Pᵀ ∘ (dPᵀ - Δ)
      dV += Pᵀ·dO,  dK += dSᵀ·Q,  dQ(tile) = dS·K   (dSᵀ through shared memory)

  Five matrix products per tile pair, none recomputed. The dQ contributions are added
  into an fp32 accumulator in global memory; a small kernel casts it at the end.

**Order of the dQ sums.** Without ``DETERMINISTIC`` each consumer stages its keys' share
of the dQ tile in shared memory and adds it with one TMA reduce-add: fast, but the fp32
sum order varies from run to run. With it, the two consumers split dQ's columns instead
(each multiplies the whole dS tile by its half of K) and hand their columns, in 32-column
chunks, through a ring of staging buffers to a one-warp **dQ writer** of their own. Each
(query tile, column half) has a semaphore: a writer adds a key tile's chunks with TMA
reduce-adds only when the count equals that key tile's rank (see ``_dq_turn``), then
passes the turn on. The consumers never wait for a turn, only for a free staging buffer,
and the two writers' turns overlap. Where shared memory has room, dS has two slots and
each tile's dQ columns are computed one tile late (``_dq_stage``), so the two consumers,
which both need each other's dS, are not held in step at every tile. With 128-row query
tiles (D <= 64) the consumers may split dQ's rows instead (``hopper_dq_rows``): each
multiplies its 64 query rows of both dS tiles by all of K, a 64 x D chunk, where the
column split's 128 x D/2 chunk takes two wgmma rows per step and reads the whole dS
tile: 1.01-1.05x on seven of ten deterministic D=64 H200 entries (0.98-1.00x on the
other three), the same bits (each element sums the same products in the same order).
dK and dV never race: one program owns each key tile, and GQA heads are summed in order.

**A free call in the fixed order's staging, without the turns** (``TURNS`` off,
``hopper_dq_unordered``, ``deterministic=False`` only): the writers add each chunk as
soon as it is staged, so the fp32 sums come in any order, and the whole accumulator is
zeroed per call (no first turn stores). With no turns to wait for, a masked call
launches each head's heaviest key tile first (ORDER 0) instead of its lightest (ORDER
1), so the grid no longer ends on long programs: at 1x16x16384x128 causal, where ncu put
the SMs idle 6.9% of the main kernel (the tail), 1.07x its turned twin (H200, session 67).

**Persistent over heads** (``PERSIST``, ``hopper_persist``, calls without a mask): the grid
is G programs per key tile (:func:`persistent_heads`: as many whole heads as the SMs hold),
and program g walks heads g, g + G, ... in turn, each head as above. The producer loads a
head's first Q and dO, then waits for the consumers to release the last head's K and V
(``kv_empty``) and loads the new ones, so a head's start overlaps the last one's end
instead of a new program's launch and prologue. Every head's key tiles run in the same
round of G heads, which the cyclic fixed order needs (a key tile waits for the others of
its head): this assumes all G x key-tile programs resident at once, as a whole GPU holds
them (one program per SM); on fewer SMs the fixed order would wait for programs that
cannot start. The one-head-per-program form is the same code with one head, its
instructions those of the kernel before the knob.

**Virtual KV heads** (``KV_REP``, ``hopper_kv_rep``, GQA): each KV head counts as r
heads of GQA / r query heads each, r programs per key tile loading the same K and V, so a
program walks 1/r of the group: under a causal mask the heaviest programs, launched last,
are r times shorter. Each virtual head's dK and dV go to a partial of their own, summed
over its r partials in fp32 after the kernel, in one order; dQ's order is per query head
and unchanged.

**How dK and dV are stored** (``hopper_dkdv_tma``): from the consumers' registers, each
thread its 4-byte pieces of 64 rows, or each consumer's rows cast into its own K and V
tiles in shared memory (the products that read them are done; in the fixed order the two
consumers first meet, since each one's dQ columns read both K tiles) and stored with TMA,
as FA3 does. Same values either way; a persistent program releases K and V for the next
head once the stores have read them.

**How dQ is staged** (``hopper_dq_frag``): in rows (or the fixed order's column groups),
the layout of the accumulator in global memory, or in the order the wgmma leaves the
values in the consumers' registers, each warp's 16-byte stores filling contiguous shared
memory; the accumulator then keeps each (query tile, column chunk) as such a block, and
the cast at the end puts it back in rows. The order of the fp32 sums is the same either
way, so the fixed order's gradients are the same bits. Split by rows, a consumer's chunk is
its half of the tile's block (``DQ_LAYOUT`` 3: the 128-row order lists the first 64 rows'
values, then the last 64's), so the accumulator and the cast are the free order's.

The softmax scale is folded into dSᵀ before its bf16/fp16 rounding, so dK and dQ need no
rescaling. Δ = rowsum(dO ∘ O) comes from the portable preprocess kernel. The producer
loads each query tile's LSE and Δ with its Q and dO, into the same stage (``STAGE_LSE``,
where shared memory has room and Sq % 4 == 0, so that TMA can describe the rows; else the
consumers load them from global memory): read in the consumers' own layout, they cost no
layout conversion through shared memory and no load latency in the consumers, which
ncu's stall sampling put at about 15% of a consumer's samples (H100, session 29). Rows past
a sequence's end come back from TMA as zeros and are masked.

This module imports Gluon's Hopper API at import time: import it only where
``flashtune.kernels.config.hopper_support()`` says the variant can run."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl
from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from flashtune.kernels._bound import BoundLaunch, descriptor_like, template
from flashtune.kernels._bwd_common import _attn_bwd_dq_finish, _attn_bwd_preprocess
from flashtune.kernels._masking import inner_range_host
from flashtune.kernels.attn_fwd_hopper import (
    ROWS_PER_WG,
    _descriptor,
    _kv_range,
    _sm_count,
    _smem_layout,
    _tanh,
    tma_describable,
)
from flashtune.kernels.config import (
    DEFAULT_SMEM_BYTES,
    BwdConfig,
    hopper_bwd_fixed_order,
    smem_bwd_hopper,
)


@builtin
def _tma_reduce_add(desc, coord, src, _semantic=None):
    """global[box at ``coord``] += shared ``src``, as one bulk TMA reduction
    (``cp.reduce.async.bulk.tensor``). Gluon 3.6 has no wrapper for the op it already
    builds for descriptor atomics; completion is waited for like a TMA store."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, desc.handle, coord,
                                              src.handle)


LOG2E = gl.constexpr(1.4426950408889634)  # 1 / ln(2): natural-log LSE -> log2 domain


@gluon.jit
def _bulk_writes_done():
    """Wait until this thread's bulk asynchronous copies have completed their writes to
    global memory (``cp.async.bulk.wait_group 0``; ``tma.store_wait`` waits only until
    they have read their shared-memory sources), then order those writes (async proxy)
    before this thread's later generic accesses, such as a release. For a one-warp
    partition."""
    lane: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    gl.inline_asm_elementwise(
        "cp.async.bulk.wait_group 0;\n\tfence.proxy.async.global;\n\tmov.b32 $0, 0;", "=r,r",
        [gl.full([32], 0, gl.int32, lane)], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _first_turn_writes_done(turn):
    """:func:`_bulk_writes_done` for the first dQ turn only (``turn == 0``), predicated
    inside the PTX instead of branched on: a runtime branch in the dQ writer grows
    consumer 0's spills (``hopper_dq_store_first=2``; BENCHMARKS.md, issue 13, session
    51). For a one-warp partition."""
    lane: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    gl.inline_asm_elementwise(
        "{\n\t.reg .pred p;\n\tsetp.eq.s32 p, $1, 0;\n\t@p cp.async.bulk.wait_group 0;"
        "\n\t@p fence.proxy.async.global;\n\tmov.b32 $0, 0;\n\t}", "=r,r",
        [gl.full([32], 0, gl.int32, lane) + turn], dtype=gl.int32, is_pure=False, pack=1)


# How far past the accumulator, in blocks, the branch-free dQ writer sends the TMA op that
# is not its turn's (hopper_dq_store_first=2): TMA writes nothing out of bounds.
PAST: gl.constexpr = gl.constexpr(1 << 24)


@gluon.jit
def _bwd_producer(desc_q, desc_do, desc_k, desc_v, LSE, Delta, q_smem, do_smem, k_smem,
                  v_smem, lse_smem, delta_smem, kv_ready, kv_empty, q_full, q_empty, do_full,
                  do_empty, heads_kv, seq_q, offset, left, right, n_m,
                  GQA: gl.constexpr, WALK: gl.constexpr, CONSUMERS: gl.constexpr,
                  BLOCK_M: gl.constexpr, STAGES: gl.constexpr, ORDER: gl.constexpr,
                  MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, STAGE_LSE: gl.constexpr,
                  PERSIST: gl.constexpr, KV_REP: gl.constexpr):
    """The loads: each (batch x KV head) of this program's key tile in turn, one head
    (the program's) or with PERSIST every G-th (see persistent_heads); with KV_REP the
    heads are virtual, KV_REP of them reading each KV head's K and V."""
    if PERSIST:
        cnt = gl.to_tensor(0)
        j = gl.to_tensor(0)
        for bhk in range(gl.program_id(1), desc_k.shape[0] * heads_kv, gl.num_programs(1)):
            cnt = _producer_head(desc_q, desc_do, desc_k, desc_v, LSE, Delta, q_smem, do_smem,
                                 k_smem, v_smem, lse_smem, delta_smem, kv_ready, kv_empty,
                                 q_full, q_empty, do_full, do_empty, heads_kv, seq_q, offset,
                                 left, right, n_m, bhk, cnt, j, GQA, WALK, CONSUMERS, BLOCK_M,
                                 STAGES, ORDER, MASK_LEFT, MASK_RIGHT, STAGE_LSE, PERSIST,
                                 KV_REP)
            j += 1
    else:
        _producer_head(desc_q, desc_do, desc_k, desc_v, LSE, Delta, q_smem, do_smem, k_smem,
                       v_smem, lse_smem, delta_smem, kv_ready, kv_empty, q_full, q_empty,
                       do_full, do_empty, heads_kv, seq_q, offset, left, right, n_m,
                       0, 0, 0, GQA, WALK, CONSUMERS, BLOCK_M, STAGES, ORDER,
                       MASK_LEFT, MASK_RIGHT, STAGE_LSE, PERSIST, KV_REP)


@gluon.jit
def _load_kv(desc_k, desc_v, k_smem, v_smem, kv_ready, kv_empty, b, hk, n0, j,
             CONSUMERS: gl.constexpr, D: gl.constexpr, WAIT: gl.constexpr):
    """Load the key tile's K and V (with WAIT, the ``j``-th head's of a persistent program,
    once the consumers have released the last head's: ``kv_empty``)."""
    if WAIT:
        mbarrier.wait(kv_empty, (j & 1) ^ 1)
    mbarrier.expect(kv_ready, 2 * CONSUMERS * desc_k.block_type.nbytes)
    for c in gl.static_range(CONSUMERS):
        k_dst = k_smem.index(c)._reinterpret(desc_k.dtype, [1, 1, 64, D], desc_k.layout)
        tma.async_copy_global_to_shared(desc_k, [b, hk, n0 + c * 64, 0], kv_ready, k_dst)
        v_dst = v_smem.index(c)._reinterpret(desc_v.dtype, [1, 1, 64, D], desc_v.layout)
        tma.async_copy_global_to_shared(desc_v, [b, hk, n0 + c * 64, 0], kv_ready, v_dst)


@gluon.jit
def _producer_head(desc_q, desc_do, desc_k, desc_v, LSE, Delta, q_smem, do_smem, k_smem,
                   v_smem, lse_smem, delta_smem, kv_ready, kv_empty, q_full, q_empty, do_full,
                   do_empty, heads_kv, seq_q, offset, left, right, n_m, bhk, cnt_in, j,
                   GQA: gl.constexpr, WALK: gl.constexpr, CONSUMERS: gl.constexpr,
                   BLOCK_M: gl.constexpr, STAGES: gl.constexpr, ORDER: gl.constexpr,
                   MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, STAGE_LSE: gl.constexpr,
                   PERSIST: gl.constexpr, KV_REP: gl.constexpr):
    """The producer's loads for (batch x KV head) ``bhk``, its ``j``-th, the stage counter
    at ``cnt_in`` (returned advanced). K and V first; with PERSIST after the head's first Q
    and dO, which so load while the consumers finish the last head."""
    BLOCK_N: gl.constexpr = 64 * CONSUMERS
    D: gl.constexpr = desc_q.block_type.shape[3]
    pid_n = _key_tile(ORDER)
    if not PERSIST:  # (read here: the one-head form keeps its instructions in order)
        bhk = gl.program_id(1)
    b = bhk // heads_kv
    hk = bhk % heads_kv
    n0 = pid_n * BLOCK_N
    if not PERSIST:
        _load_kv(desc_k, desc_v, k_smem, v_smem, kv_ready, kv_empty, b, hk // KV_REP, n0, j,
                 CONSUMERS, D, False)
    # Query tiles that see this key tile (roles swapped: offset -> -offset, left <-> right).
    lo, full_lo, full_hi, hi = _kv_range(n0, seq_q, -offset, right, left, BLOCK_N, BLOCK_M,
                                         MASK_RIGHT, MASK_LEFT)
    # LSE and Δ: BLOCK_M fp32 values of row b * Hq + h of the (B*Hq, Sq) arrays; TMA reads
    # the columns past Sq as zeros (P is masked there; dO's zero rows make dS zero).
    ROW_BYTES: gl.constexpr = 4 * BLOCK_M if STAGE_LSE else 0
    if PERSIST:
        cnt = cnt_in
    else:
        cnt = 0
    c0 = cnt
    FLAT: gl.constexpr = GQA > 1 and WALK == 1
    for g0 in range(1 if FLAT else GQA):
        g = g0
        h = hk * GQA + g
        bh = b * (heads_kv * GQA) + h
        for it in range(GQA * ((hi - lo) // BLOCK_M) if FLAT else (hi - lo) // BLOCK_M):
            if FLAT:  # the group's heads in one walk (see _walk)
                g, it = _walk(it, (hi - lo) // BLOCK_M)
                h = hk * GQA + g
                bh = b * (heads_kv * GQA) + h
            start = _query_tile(it, lo, n_m, pid_n, ORDER, BLOCK_M)
            buf = cnt % STAGES
            phase = ((cnt // STAGES) & 1) ^ 1
            mbarrier.wait(q_empty.index(buf), phase)
            mbarrier.expect(q_full.index(buf), desc_q.block_type.nbytes + ROW_BYTES)
            q_dst = q_smem.index(buf)._reinterpret(desc_q.dtype, [1, 1, BLOCK_M, D],
                                                   desc_q.layout)
            tma.async_copy_global_to_shared(desc_q, [b, h, start, 0], q_full.index(buf), q_dst)
            if STAGE_LSE:
                lse_dst = lse_smem.index(buf)._reinterpret(gl.float32, [1, BLOCK_M], LSE.layout)
                tma.async_copy_global_to_shared(LSE, [bh, start], q_full.index(buf), lse_dst)
            mbarrier.wait(do_empty.index(buf), phase)
            mbarrier.expect(do_full.index(buf), desc_do.block_type.nbytes + ROW_BYTES)
            do_dst = do_smem.index(buf)._reinterpret(desc_do.dtype, [1, 1, BLOCK_M, D],
                                                     desc_do.layout)
            tma.async_copy_global_to_shared(desc_do, [b, h, start, 0], do_full.index(buf),
                                            do_dst)
            if STAGE_LSE:
                delta_dst = delta_smem.index(buf)._reinterpret(gl.float32, [1, BLOCK_M],
                                                               Delta.layout)
                tma.async_copy_global_to_shared(Delta, [bh, start], do_full.index(buf),
                                                delta_dst)
            if PERSIST:
                if cnt == c0:  # this head's first Q and dO are on their way: now K and V
                    _load_kv(desc_k, desc_v, k_smem, v_smem, kv_ready, kv_empty, b,
                             hk // KV_REP, n0, j, CONSUMERS, D, True)
            cnt += 1
    if PERSIST:
        if cnt == c0:  # a head without query tiles: its K and V all the same
            _load_kv(desc_k, desc_v, k_smem, v_smem, kv_ready, kv_empty, b, hk // KV_REP, n0, j,
                     CONSUMERS, D, True)
    return cnt


@gluon.jit
def _walk(step, tiles):
    """(query head of the group, query tile) of a GQA program's ``step`` in the flat walk
    (``hopper_walk`` 1): every partition walks the group's heads in one loop, not a loop per
    head (``hopper_walk`` 0, the code before it). With the loop per head, ptxas spilled
    consumer 0's registers at 64-row tiles and D=128 (about 200 bytes, reloaded at every
    query tile) and the fixed order ran 15% behind the free one; the flat walk spills
    nothing there (H200, session 34; ``benchmarks/experiments/bwd_spills.py``), but more
    than the loop per head with 128-row tiles at D=64. Without GQA the two are one code."""
    g = step // tiles
    return g, step - g * tiles


@gluon.jit
def _key_tile(ORDER: gl.constexpr):
    """This program's key tile. ORDER 1 walks them from the last, so that the tile whose
    dQ turn comes first is also launched first (a program only waits for earlier ones)."""
    if ORDER == 1:
        return gl.num_programs(0) - 1 - gl.program_id(0)
    return gl.program_id(0)


@gluon.jit
def _query_tile(it, lo, n_m, pid_n, ORDER: gl.constexpr, BLOCK_M: gl.constexpr):
    """Start row of the ``it``-th query tile a program visits. ORDER 2 (no mask: every
    program visits all ``n_m`` tiles) starts each key tile's walk at its own offset and
    wraps around, so the programs of one head reach each query tile one after another
    instead of all at once."""
    if ORDER == 2:
        first = pid_n * n_m // gl.num_programs(0)
        return ((first + it) % n_m) * BLOCK_M
    return lo + it * BLOCK_M


@gluon.jit
def _dq_turn(Sem, sem_row, start, pid_n, cid: gl.constexpr, n_m, seq_k, offset, left, right,
             CONSUMERS: gl.constexpr, BLOCK_M: gl.constexpr, ORDER: gl.constexpr,
             MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr):
    """This consumer's place in the fixed order of dQ contributions to one query tile, and
    that tile's semaphore. The key tiles that see a query tile form a run [first, last];
    they take turns in the order they reach it when programs advance in step: ORDER 0
    ascending; ORDER 1 (masked: a later key tile starts its walk at a later query tile, so
    it reaches each query tile sooner) descending; ORDER 2 cyclically, from the key tile
    whose walk started at or last before the query tile. Each consumer's columns of dQ
    are added by its own writer, so each has its own semaphore."""
    BLOCK_N: gl.constexpr = 64 * CONSUMERS
    n_n = gl.num_programs(0)
    m = start // BLOCK_M
    if ORDER == 2:
        lead = ((m + 1) * n_n + n_m - 1) // n_m - 1
        rank = (lead - pid_n + n_n) % n_n
    else:
        first, _a, _b, last = _kv_range(start, seq_k, offset, left, right, BLOCK_M, BLOCK_N,
                                        MASK_LEFT, MASK_RIGHT)
        if ORDER == 1:
            rank = last // BLOCK_N - 1 - pid_n
        else:
            rank = pid_n - first // BLOCK_N
    return Sem + (sem_row + m) * CONSUMERS + cid, rank


@gluon.jit
def _dq_chunk(ds_smem, ds_base, ds_buf, k_smem, cid: gl.constexpr, c: gl.constexpr,
              BLOCK_M: gl.constexpr, DQ_COLS: gl.constexpr, DQ_CHUNK: gl.constexpr,
              CONSUMERS: gl.constexpr, SPLIT_D: gl.constexpr, dq_layout: gl.constexpr,
              ROWS: gl.constexpr = False):
    """Issue (asynchronously) chunk ``c`` of this consumer's dQ columns: over every
    consumer's keys (the dS tiles from ``ds_base`` on) when the consumers split dQ's
    columns (SPLIT_D), else over its own. With ROWS (``hopper_dq_rows``, 128-row query
    tiles) the consumers split dQ's rows instead: consumer ``cid`` takes query rows
    [64 cid, 64 cid + 64) of every column, a [64, DQ_CHUNK] chunk over every consumer's
    keys."""
    QR: gl.constexpr = 64 if ROWS else BLOCK_M
    dq = gl.zeros([QR, DQ_CHUNK], gl.float32, layout=dq_layout)
    if ROWS:
        for j in gl.static_range(CONSUMERS):
            dq = warpgroup_mma(ds_smem.index(ds_base + j).slice(cid * 64, 64, dim=1)
                               .permute((1, 0)),
                               k_smem.index(j).slice(c * DQ_CHUNK, DQ_CHUNK, dim=1), dq,
                               is_async=True)
    elif SPLIT_D:
        for j in gl.static_range(CONSUMERS):
            dq = warpgroup_mma(ds_smem.index(ds_base + j).permute((1, 0)),
                               k_smem.index(j).slice(cid * DQ_COLS + c * DQ_CHUNK, DQ_CHUNK,
                                                     dim=1),
                               dq, is_async=True)
    else:
        dq = warpgroup_mma(ds_buf.permute((1, 0)),
                           k_smem.index(cid).slice(c * DQ_CHUNK, DQ_CHUNK, dim=1), dq,
                           is_async=True)
    return dq


@gluon.jit
def _grouped(dq):
    """A fixed-order dQ chunk [BLOCK_M, DQ_CHUNK] as its column groups of eight,
    [DQ_CHUNK // 8, BLOCK_M, 8]: the staging order of ``hopper_dq_groups=1`` (a register
    reshape and permute, no data movement). The wgmma accumulator's lanes 0-15 hold rows
    0-3; staged in rows of DQ_CHUNK columns, each half-warp's 64-bit stores fall on the
    same two 16-byte units of four 128-byte rows (2-way bank conflicts, which the 128-byte
    swizzle does not break), staged in groups they fill one 128-byte line."""
    M: gl.constexpr = dq.shape[0]
    N: gl.constexpr = dq.shape[1]
    return gl.permute(gl.reshape(dq, [M, N // 8, 8]), (1, 0, 2))


@gluon.jit
def _fragments(dq):
    """A dQ tile [BLOCK_M, N] in the order its registers lie in the wgmma accumulator,
    flat in rows of 256 values, [BLOCK_M * N / 256, 256]: value 4 (128 k + t) + i is
    thread t's k-th group of four (rows r and r + 8, columns c and c + 1). Staged so
    (``hopper_dq_frag``), each warp's 16-byte stores fill 512 contiguous bytes of shared
    memory: no bank conflicts, no swizzle, half the store instructions of 8-byte pieces;
    the TMA reduce-add reads 1 KiB rows. The fp32 accumulator in global memory then holds
    each tile in this order too (a contiguous block per query tile and column chunk), and
    ``_dq_finish_fragments`` puts it back in rows.

    In the accumulator (``instr_shape=[16, N, 16]``, four warps) thread t = 32 w + 4 a + e'
    of a 64-row block holds rows 16 w + 8 h + a and columns 8 j + 2 e' + e: split the rows
    as [blocks, w, h, a] and the columns as [j, e', e], and gather them as
    [blocks, j, w, a, e', h, e]. A register relabelling: no data moves."""
    M: gl.constexpr = dq.shape[0]
    N: gl.constexpr = dq.shape[1]
    x = gl.reshape(dq, [M // 64, 4, 2, 8, N // 8, 4, 2])
    x = gl.permute(x, (0, 4, 1, 3, 5, 2, 6))
    return gl.reshape(x, [M * N // 256, 256])


@gluon.jit
def _bwd_dq_writer(cid: gl.constexpr, desc_dq, dq_smem, dq_full, dq_empty, Sem, heads_kv, seq_q,
                   seq_k, offset, left, right, n_m, GQA: gl.constexpr, WALK: gl.constexpr,
                   CONSUMERS: gl.constexpr, BLOCK_M: gl.constexpr, D: gl.constexpr,
                   ORDER: gl.constexpr, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr,
                   DQ_RING: gl.constexpr, DQ_LAYOUT: gl.constexpr, STORE_FIRST: gl.constexpr,
                   PERSIST: gl.constexpr, TURNS: gl.constexpr):
    """The fixed order's dQ adds of consumer ``cid``'s columns, in one warp (one writer per
    consumer: their column halves have semaphores of their own, so the two writers' turns
    overlap): for each query tile the program visits, in the consumers' order, wait for
    this key tile's turn, add the staged chunks with TMA reduce-adds, and pass the turn on
    once the reductions have read their sources (as FA3 orders its bulk reduce-adds). The
    consumer only waits for a free staging buffer, so a turn's wait overlaps its next
    tiles' work. With ``DQ_LAYOUT`` 1 a chunk is staged and added in column groups of
    eight (see _grouped) through a rank-5 view of the accumulator, [b, hq, D / 8, sq, 8];
    with 2 in register order (see _fragments), as a block of its own."""
    if PERSIST:
        cnt = gl.to_tensor(0)
        for bhk in range(gl.program_id(1), _heads_of(desc_dq, heads_kv, GQA, DQ_LAYOUT),
                         gl.num_programs(1)):
            cnt = _writer_head(cid, desc_dq, dq_smem, dq_full, dq_empty, Sem, heads_kv, seq_q,
                               seq_k, offset, left, right, n_m, bhk, cnt, GQA, WALK, CONSUMERS,
                               BLOCK_M, D, ORDER, MASK_LEFT, MASK_RIGHT, DQ_RING, DQ_LAYOUT,
                               STORE_FIRST, PERSIST, TURNS)
    else:
        _writer_head(cid, desc_dq, dq_smem, dq_full, dq_empty, Sem, heads_kv, seq_q, seq_k,
                     offset, left, right, n_m, 0, 0, GQA, WALK, CONSUMERS,
                     BLOCK_M, D, ORDER, MASK_LEFT, MASK_RIGHT, DQ_RING, DQ_LAYOUT, STORE_FIRST,
                     PERSIST, TURNS)


@gluon.jit
def _heads_of(desc_dq, heads_kv, GQA: gl.constexpr, DQ_LAYOUT: gl.constexpr):
    """Batch x KV heads of the call, from the dQ accumulator's descriptor: [B * Hq, ...]
    in fragment order (DQ_LAYOUT 2 or 3), else [B, Hq, ...]."""
    if DQ_LAYOUT >= 2:
        return desc_dq.shape[0] // GQA
    return desc_dq.shape[0] * heads_kv


@gluon.jit
def _writer_head(cid: gl.constexpr, desc_dq, dq_smem, dq_full, dq_empty, Sem, heads_kv, seq_q,
                 seq_k, offset, left, right, n_m, bhk, cnt_in, GQA: gl.constexpr,
                 WALK: gl.constexpr, CONSUMERS: gl.constexpr, BLOCK_M: gl.constexpr,
                 D: gl.constexpr, ORDER: gl.constexpr, MASK_LEFT: gl.constexpr,
                 MASK_RIGHT: gl.constexpr, DQ_RING: gl.constexpr, DQ_LAYOUT: gl.constexpr,
                 STORE_FIRST: gl.constexpr, PERSIST: gl.constexpr, TURNS: gl.constexpr):
    """The dQ writer's turns for (batch x KV head) ``bhk``, its ring counter at ``cnt_in``
    (returned advanced)."""
    BLOCK_N: gl.constexpr = 64 * CONSUMERS
    # The dQ columns of one staging buffer, from the accumulator descriptor's box: rows
    # [1, 1, BLOCK_M, N], column groups [1, 1, N / 8, BLOCK_M, 8] or fragments
    # [1, 1, BLOCK_M * N / 256, 256] (DQ_LAYOUT 0, 1, 2); with DQ_LAYOUT 3 (fragments, the
    # consumers splitting dQ's rows: hopper_dq_rows) a consumer's 64 rows of the block,
    # [1, 1, 64 * N / 256, 256], at row ROW0 of the tile's block.
    QR: gl.constexpr = 64 if DQ_LAYOUT == 3 else BLOCK_M
    DQ_CHUNK: gl.constexpr = (desc_dq.block_type.shape[2] * 256 // QR if DQ_LAYOUT >= 2
                              else desc_dq.block_type.shape[2] * desc_dq.block_type.shape[4]
                              if DQ_LAYOUT == 1 else desc_dq.block_type.shape[3])
    DQ_COLS: gl.constexpr = D if DQ_LAYOUT == 3 else D // CONSUMERS
    CHUNKS: gl.constexpr = DQ_COLS // DQ_CHUNK
    ROW0: gl.constexpr = cid * (64 * DQ_CHUNK // 256) if DQ_LAYOUT == 3 else 0
    pid_n = _key_tile(ORDER)
    if not PERSIST:  # (read here: the one-head form keeps its instructions in order)
        bhk = gl.program_id(1)
    b = bhk // heads_kv
    hk = bhk % heads_kv
    heads_q = heads_kv * GQA
    lo, full_lo, full_hi, hi = _kv_range(pid_n * BLOCK_N, seq_q, -offset, right, left, BLOCK_N,
                                         BLOCK_M, MASK_RIGHT, MASK_LEFT)
    if PERSIST:
        cnt = cnt_in
    else:
        cnt = 0
    FLAT: gl.constexpr = GQA > 1 and WALK == 1
    for g0 in range(1 if FLAT else GQA):
        g = g0
        h = hk * GQA + g
        bh = (b * heads_q + h).to(gl.int64)
        for it in range(GQA * ((hi - lo) // BLOCK_M) if FLAT else (hi - lo) // BLOCK_M):
            if FLAT:  # the group's heads in one walk (see _walk)
                g, it = _walk(it, (hi - lo) // BLOCK_M)
                h = hk * GQA + g
                bh = (b * heads_q + h).to(gl.int64)
            start = _query_tile(it, lo, n_m, pid_n, ORDER, BLOCK_M)
            if TURNS:
                sem, turn = _dq_turn(Sem, bh * n_m, start, pid_n, cid, n_m, seq_k, offset,
                                     left, right, CONSUMERS, BLOCK_M, ORDER, MASK_LEFT,
                                     MASK_RIGHT)
                while gl.atomic_add(sem, 0, sem="acquire") != turn:
                    pass
            for c in gl.static_range(CHUNKS):
                slot = (cnt * CHUNKS + c) % DQ_RING
                mbarrier.wait(dq_full.index(cid * DQ_RING + slot),
                              ((cnt * CHUNKS + c) // DQ_RING) & 1)
                if DQ_LAYOUT >= 2:  # the block of this query tile and column chunk
                    block = (start // BLOCK_M) * (D // DQ_CHUNK) + (
                        c if DQ_LAYOUT == 3 else cid * CHUNKS + c)
                    if STORE_FIRST:  # the first turn stores: the accumulator is not zeroed
                        src = dq_smem.index(cid * DQ_RING + slot)._reinterpret(
                            gl.float32, [1, 1, QR * DQ_CHUNK // 256, 256], desc_dq.layout)
                        if STORE_FIRST == 2:  # both ops, no branch: the other one's box
                            first = turn == 0  # lies PAST the accumulator
                            tma.async_copy_shared_to_global(
                                desc_dq, [b * heads_q + h, gl.where(first, block, block + PAST),
                                          ROW0, 0], src)
                            _tma_reduce_add(
                                desc_dq, [b * heads_q + h, gl.where(first, block + PAST, block),
                                          ROW0, 0], src)
                        elif turn == 0:
                            tma.async_copy_shared_to_global(
                                desc_dq, [b * heads_q + h, block, ROW0, 0], src)
                        else:
                            _tma_reduce_add(desc_dq, [b * heads_q + h, block, ROW0, 0], src)
                    else:
                        _tma_reduce_add(desc_dq, [b * heads_q + h, block, ROW0, 0],
                                        dq_smem.index(cid * DQ_RING + slot)._reinterpret(
                                            gl.float32, [1, 1, QR * DQ_CHUNK // 256, 256],
                                            desc_dq.layout))
                elif DQ_LAYOUT == 1:
                    _tma_reduce_add(desc_dq, [b, h, (cid * DQ_COLS + c * DQ_CHUNK) // 8, start, 0],
                                    dq_smem.index(cid * DQ_RING + slot)._reinterpret(
                                        gl.float32, [1, 1, DQ_CHUNK // 8, BLOCK_M, 8],
                                        desc_dq.layout))
                else:
                    _tma_reduce_add(desc_dq, [b, h, start, cid * DQ_COLS + c * DQ_CHUNK],
                                    dq_smem.index(cid * DQ_RING + slot)._reinterpret(
                                        gl.float32, [1, 1, BLOCK_M, DQ_CHUNK], desc_dq.layout))
            tma.store_wait(0)
            for c in gl.static_range(CHUNKS):
                mbarrier.arrive(dq_empty.index(cid * DQ_RING + (cnt * CHUNKS + c) % DQ_RING),
                                count=1)
            # The next turn's reduce-adds must find the first turn's stores done, not only
            # their sources read: wait for the writes themselves.
            if STORE_FIRST == 2:
                _first_turn_writes_done(turn)
            elif STORE_FIRST:
                if turn == 0:
                    _bulk_writes_done()
            if TURNS:
                gl.atomic_xchg(sem, turn + 1, sem="release")
            cnt += 1
    return cnt


@gluon.jit
def _dq_stage(t, cid: gl.constexpr, ds_smem, k_smem, dq_smem, ds_ready, ds_free, dq_full,
              dq_empty, BLOCK_M: gl.constexpr, DQ_COLS: gl.constexpr, DQ_CHUNK: gl.constexpr,
              CONSUMERS: gl.constexpr, DQ_RING: gl.constexpr, dq_layout: gl.constexpr,
              DQ_LAYOUT: gl.constexpr):
    """The fixed order's dQ columns of this consumer for the ``t``-th tile of its walk,
    when they are computed one tile late (DEFER): wait for both consumers' dS of it in
    its slot, then hand the columns to the writer in chunks through the staging ring
    (chunk c + 1's product runs while chunk c is staged), and free the slot."""
    CHUNKS: gl.constexpr = DQ_COLS // DQ_CHUNK
    slot = t % 2
    mbarrier.wait(ds_ready.index(slot), (t // 2) & 1)
    base = slot * CONSUMERS
    dq = _dq_chunk(ds_smem, base, ds_smem.index(base + cid), k_smem, cid, 0, BLOCK_M, DQ_COLS,
                   DQ_CHUNK, CONSUMERS, True, dq_layout, DQ_LAYOUT == 3)
    for c in gl.static_range(CHUNKS):
        dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq, ))
        if c + 1 == CHUNKS:
            mbarrier.arrive(ds_free.index(slot), count=1)
        r = t * CHUNKS + c
        mbarrier.wait(dq_empty.index(cid * DQ_RING + r % DQ_RING), ((r // DQ_RING) & 1) ^ 1)
        if DQ_LAYOUT >= 2:
            dq_smem.index(cid * DQ_RING + r % DQ_RING).store(_fragments(dq))
        elif DQ_LAYOUT == 1:
            dq_smem.index(cid * DQ_RING + r % DQ_RING).store(_grouped(dq))
        else:
            dq_smem.index(cid * DQ_RING + r % DQ_RING).store(dq)
        fence_async_shared()
        gl.thread_barrier()
        if c + 1 < CHUNKS:
            dq = _dq_chunk(ds_smem, base, ds_smem.index(base + cid), k_smem, cid, c + 1,
                           BLOCK_M, DQ_COLS, DQ_CHUNK, CONSUMERS, True, dq_layout,
                           DQ_LAYOUT == 3)
        mbarrier.arrive(dq_full.index(cid * DQ_RING + r % DQ_RING), count=1)


@gluon.jit
def _bwd_consumer(cid: gl.constexpr, q_smem, do_smem, k_smem, v_smem, ds_smem, dq_smem,
                  lse_smem, delta_smem, kv_ready, kv_empty, kv_done, q_full, q_empty, do_full,
                  do_empty,
                  ds_ready, ds_free, dq_full, dq_empty, LSE, Delta, desc_dq, DK, DV,
                  stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
                  heads_kv, seq_q, seq_k, offset, left, right, n_m,
                  sm_scale, qk_scale, cap_scale, cap_log2,
                  GQA: gl.constexpr, WALK: gl.constexpr, CONSUMERS: gl.constexpr,
                  BLOCK_M: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr, ORDER: gl.constexpr,
                  MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, SOFTCAP: gl.constexpr,
                  DETERMINISTIC: gl.constexpr, DQ_RING: gl.constexpr, DS_BUFS: gl.constexpr,
                  STAGE_LSE: gl.constexpr, DQ_LAYOUT: gl.constexpr, KV_REGS: gl.constexpr,
                  PERSIST: gl.constexpr, DKDV_TMA: gl.constexpr):
    """Consumer ``cid``: its 64 keys of the key tile against each query tile of one
    (batch x KV head), the program's, or with PERSIST of every G-th in turn."""
    if PERSIST:
        cnt = gl.to_tensor(0)
        j = gl.to_tensor(0)
        for bhk in range(gl.program_id(1), _heads_of(desc_dq, heads_kv, GQA, DQ_LAYOUT),
                         gl.num_programs(1)):
            cnt = _consumer_head(
                cid, q_smem, do_smem, k_smem, v_smem, ds_smem, dq_smem, lse_smem, delta_smem,
                kv_ready, kv_empty, kv_done, q_full, q_empty, do_full, do_empty, ds_ready, ds_free,
                dq_full, dq_empty, LSE, Delta, desc_dq, DK, DV, stride_dkb, stride_dkh,
                stride_dkn, stride_dvb, stride_dvh, stride_dvn, heads_kv, seq_q, seq_k, offset,
                left, right, n_m, sm_scale, qk_scale, cap_scale, cap_log2, bhk, cnt, j, GQA,
                WALK, CONSUMERS, BLOCK_M, D, STAGES, ORDER, MASK_LEFT, MASK_RIGHT, SOFTCAP,
                DETERMINISTIC, DQ_RING, DS_BUFS, STAGE_LSE, DQ_LAYOUT, KV_REGS, PERSIST,
                DKDV_TMA)
            j += 1
    else:
        _consumer_head(
            cid, q_smem, do_smem, k_smem, v_smem, ds_smem, dq_smem, lse_smem, delta_smem,
            kv_ready, kv_empty, kv_done, q_full, q_empty, do_full, do_empty, ds_ready, ds_free,
            dq_full, dq_empty, LSE, Delta, desc_dq, DK, DV, stride_dkb, stride_dkh, stride_dkn,
            stride_dvb, stride_dvh, stride_dvn, heads_kv, seq_q, seq_k, offset, left, right,
            n_m, sm_scale, qk_scale, cap_scale, cap_log2, 0, 0, 0, GQA, WALK,
            CONSUMERS, BLOCK_M, D, STAGES, ORDER, MASK_LEFT, MASK_RIGHT, SOFTCAP,
            DETERMINISTIC, DQ_RING, DS_BUFS, STAGE_LSE, DQ_LAYOUT, KV_REGS, PERSIST, DKDV_TMA)


@gluon.jit
def _consumer_head(cid: gl.constexpr, q_smem, do_smem, k_smem, v_smem, ds_smem, dq_smem,
                   lse_smem, delta_smem, kv_ready, kv_empty, kv_done, q_full, q_empty, do_full,
                   do_empty, ds_ready, ds_free, dq_full, dq_empty, LSE, Delta, desc_dq, DK, DV,
                   stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
                   heads_kv, seq_q, seq_k, offset, left, right, n_m,
                   sm_scale, qk_scale, cap_scale, cap_log2, bhk, cnt_in, j,
                   GQA: gl.constexpr, WALK: gl.constexpr, CONSUMERS: gl.constexpr,
                   BLOCK_M: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr,
                   ORDER: gl.constexpr, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr,
                   SOFTCAP: gl.constexpr, DETERMINISTIC: gl.constexpr, DQ_RING: gl.constexpr,
                   DS_BUFS: gl.constexpr, STAGE_LSE: gl.constexpr, DQ_LAYOUT: gl.constexpr,
                   KV_REGS: gl.constexpr, PERSIST: gl.constexpr, DKDV_TMA: gl.constexpr):
    """Consumer ``cid``'s work on (batch x KV head) ``bhk``, its ``j``-th, the stage
    counter at ``cnt_in`` (returned advanced); dK and dV stored at the end: from registers,
    or with DKDV_TMA through this consumer's K and V tiles in shared memory (TMA stores;
    ``DK`` and ``DV`` are then tensor descriptors)."""
    BLOCK_N: gl.constexpr = 64 * CONSUMERS
    # Sᵀ / dPᵀ: [64 keys, BLOCK_M queries]; dK, dV and dQ tiles: [64, D].
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_M, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, D, 16])
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout,
                                                  k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    row_a: gl.constexpr = gl.SliceLayout(1, acc_layout)
    col_a: gl.constexpr = gl.SliceLayout(0, acc_layout)
    dtype: gl.constexpr = k_smem.dtype

    pid_n = _key_tile(ORDER)
    if not PERSIST:  # (read here: the one-head form keeps its instructions in order)
        bhk = gl.program_id(1)
    b = bhk // heads_kv
    hk = bhk % heads_kv
    heads_q = heads_kv * GQA
    n0 = pid_n * BLOCK_N
    keys = n0 + cid * 64 + gl.arange(0, 64, layout=row_s)
    zero_s = gl.zeros([64, BLOCK_M], gl.float32, layout=s_layout)
    SPLIT_D: gl.constexpr = DETERMINISTIC and CONSUMERS == 2
    DEFER: gl.constexpr = SPLIT_D and DS_BUFS == 2
    # With 128-row query tiles the fixed order issues dP only once P is computed: Sᵀ and
    # dPᵀ (64 registers each) are then never live together, which keeps ptxas from
    # spilling; the free order keeps the overlap, which pays more there
    # (benchmarks/experiments/bwd_dp_after_p.patch).
    DP_LATE: gl.constexpr = DETERMINISTIC and BLOCK_M == 128
    DQ_COLS: gl.constexpr = D // CONSUMERS if DETERMINISTIC and DQ_LAYOUT != 3 else D
    # The fixed order hands its dQ columns to the writer in chunks of DQ_CHUNK (see the
    # staging buffers in the kernel); the free order stages the whole tile at once.
    # The dQ columns of one staging buffer, from the accumulator descriptor's box: rows
    # [1, 1, BLOCK_M, N], column groups [1, 1, N / 8, BLOCK_M, 8] or fragments
    # [1, 1, BLOCK_M * N / 256, 256] (DQ_LAYOUT 0, 1, 2), or a consumer's 64 rows of the
    # fragments (DQ_LAYOUT 3: the consumers split dQ's rows, each all D columns).
    DQ_CHUNK: gl.constexpr = (desc_dq.block_type.shape[2] * 256 // BLOCK_M if DQ_LAYOUT == 2
                              else desc_dq.block_type.shape[2] * 256 // 64 if DQ_LAYOUT == 3
                              else desc_dq.block_type.shape[2] * desc_dq.block_type.shape[4]
                              if DQ_LAYOUT == 1 else desc_dq.block_type.shape[3])
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, DQ_CHUNK, 16])
    # Where dK, dV and a dQ tile hold more registers than at D=64 with 64-row query tiles,
    # LSE and Δ are read only at the line that uses them (staged: from shared memory;
    # otherwise they wait in a layout of one value per thread until then), and dK and dV
    # complete before dQ's product is issued. With all three accumulators,
    # both register operands and 32 registers of LSE and Δ live at once, ptxas runs out
    # of registers there and serializes every wgmma of the loop; at D=64 with 64-row
    # tiles nothing spills, and the overlap is worth more (benchmarks/experiments/
    # hopper_bwd_ab.py).
    LEAN: gl.constexpr = D * BLOCK_M > 64 * 64
    vec_layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    dk = gl.zeros([64, D], gl.float32, layout=acc_layout)
    dv = gl.zeros([64, D], gl.float32, layout=acc_layout)
    k = k_smem.index(cid)
    v = v_smem.index(cid)
    ds_buf = ds_smem.index(cid)
    lo, full_lo, full_hi, hi = _kv_range(n0, seq_q, -offset, right, left, BLOCK_N, BLOCK_M,
                                         MASK_RIGHT, MASK_LEFT)
    mbarrier.wait(kv_ready, j & 1)
    if KV_REGS:
        # hopper_kv_regs (D=64): the consumer's K and V tiles (16 registers each) stay in
        # registers as the left operands of Sᵀ and dPᵀ, so those two products read only
        # Qᵀ and dOᵀ from shared memory, whose bandwidth the five products share. With
        # 64-row query tiles 1.02-1.07x on the H200; with 128-row ones 0.76-0.95x in the
        # free dQ order and 0.97-1.07x in the fixed one (BENCHMARKS.md, issue 13).
        gl.static_assert(D == 64)
        kv_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)
        k_a = k.load(kv_op)
        v_a = v.load(kv_op)
    else:
        k_a = k
        v_a = v
    if PERSIST:
        cnt = cnt_in
    else:
        cnt = 0
    cnt0 = cnt
    FLAT: gl.constexpr = GQA > 1 and WALK == 1
    for g0 in range(1 if FLAT else GQA):
        g = g0
        bh = (b * heads_q + hk * GQA + g).to(gl.int64)
        for it in range(GQA * ((hi - lo) // BLOCK_M) if FLAT else (hi - lo) // BLOCK_M):
            if FLAT:  # the group's heads in one walk (see _walk)
                g, it = _walk(it, (hi - lo) // BLOCK_M)
                bh = (b * heads_q + hk * GQA + g).to(gl.int64)
            start = _query_tile(it, lo, n_m, pid_n, ORDER, BLOCK_M)
            buf = cnt % STAGES
            phase = (cnt // STAGES) & 1
            if STAGE_LSE:
                pass  # LSE and Δ come with the stage (see the producer)
            elif LEAN:
                rows_v = start + gl.arange(0, BLOCK_M, layout=vec_layout)
                lse_v = gl.load(LSE + bh * seq_q + rows_v, mask=rows_v < seq_q,
                                other=float("inf"))
                delta_v = gl.load(Delta + bh * seq_q + rows_v, mask=rows_v < seq_q, other=0.0)
            else:
                cols_v = start + gl.arange(0, BLOCK_M, layout=col_s)
                lse2 = gl.load(LSE + bh * seq_q + cols_v, mask=cols_v < seq_q,
                               other=float("inf")) * LOG2E
                delta = gl.load(Delta + bh * seq_q + cols_v, mask=cols_v < seq_q, other=0.0)
            q = q_smem.index(buf)
            do = do_smem.index(buf)
            mbarrier.wait(q_full.index(buf), phase)
            s_t = warpgroup_mma(k_a, q.permute((1, 0)), zero_s, use_acc=False, is_async=True)
            if STAGE_LSE and not LEAN:  # read while the product runs
                lse2 = lse_smem.index(buf).load(col_s) * LOG2E
            if DP_LATE:
                s_t = warpgroup_mma_wait(num_outstanding=0, deps=(s_t, ))
            else:
                mbarrier.wait(do_full.index(buf), phase)
                dp_t = warpgroup_mma(v_a, do.permute((1, 0)), zero_s, use_acc=False,
                                     is_async=True)
                s_t = warpgroup_mma_wait(num_outstanding=1, deps=(s_t, ))
            if STAGE_LSE:
                if LEAN:  # read once Sᵀ is in: no room for it beside the products
                    lse2 = lse_smem.index(buf).load(col_s) * LOG2E
            elif LEAN:
                lse2 = gl.convert_layout(lse_v * LOG2E, col_s)
            if SOFTCAP:
                t = _tanh(s_t * cap_scale)
                p_t = gl.exp2(t * cap_log2 - lse2[None, :])
            else:
                p_t = gl.exp2(s_t * qk_scale - lse2[None, :])
            if (start < full_lo) | (start >= full_hi):
                # Key j (row) is seen by query i (column) iff
                # i + offset - left <= j <= i + offset + right.
                cols = start + gl.arange(0, BLOCK_M, layout=col_s)
                vis = (cols[None, :] < seq_q) & (keys[:, None] < seq_k)
                if MASK_LEFT:
                    vis = vis & (keys[:, None] >= cols[None, :] + offset - left)
                if MASK_RIGHT:
                    vis = vis & (keys[:, None] <= cols[None, :] + offset + right)
                p_t = gl.where(vis, p_t, 0.0)
            if DP_LATE:
                mbarrier.wait(do_full.index(buf), phase)
                dp_t = warpgroup_mma(v_a, do.permute((1, 0)), zero_s, use_acc=False,
                                     is_async=True)
            dp_t = warpgroup_mma_wait(num_outstanding=0, deps=(dp_t, ))
            if STAGE_LSE:
                delta = delta_smem.index(buf).load(col_s)
            elif LEAN:
                delta = gl.convert_layout(delta_v, col_s)
            ds_t = p_t * (dp_t - delta[None, :])
            if SOFTCAP:
                ds_t = ds_t * (1.0 - t * t)  # d/dx tanh = 1 - tanh^2
            ds16 = (ds_t * sm_scale).to(dtype)
            dv = warpgroup_mma(gl.convert_layout(p_t.to(dtype), op_layout), do, dv,
                               is_async=True)
            dk = warpgroup_mma(gl.convert_layout(ds16, op_layout), q, dk, is_async=True)
            # dQ = dS·K: each consumer's dSᵀ goes through shared memory (read transposed).
            # In the fixed order (SPLIT_D) each consumer computes its own DQ_COLS columns
            # over all BLOCK_N keys, so the two take their turns on disjoint columns;
            # otherwise each adds its own keys' share of every column, and the consumers
            # run unsynchronised (one's exponentials overlap the other's products).
            if DEFER:
                # dS goes to this tile's slot, and the dQ columns of the previous tile are
                # computed now, once both consumers' dS of it are in: a consumer waits for
                # the other one tile late, so the two drift apart instead of meeting at
                # every tile, and one's exponentials overlap the other's products.
                slot = cnt % 2
                mbarrier.wait(ds_free.index(slot), ((cnt // 2) & 1) ^ 1)
                ds_smem.index(slot * CONSUMERS + cid).store(ds16)
                fence_async_shared()
                gl.thread_barrier()
                mbarrier.arrive(ds_ready.index(slot), count=1)
                dk, dv = warpgroup_mma_wait(num_outstanding=0, deps=(dk, dv))
                mbarrier.arrive(q_empty.index(buf), count=1)
                mbarrier.arrive(do_empty.index(buf), count=1)
                if cnt > cnt0:
                    _dq_stage(cnt - 1, cid, ds_smem, k_smem, dq_smem, ds_ready, ds_free,
                              dq_full, dq_empty, BLOCK_M, DQ_COLS, DQ_CHUNK, CONSUMERS,
                              DQ_RING, dq_layout, DQ_LAYOUT)
            else:
                if SPLIT_D:
                    mbarrier.wait(ds_free.index(0), (cnt & 1) ^ 1)  # the last tile's dQ is done
                ds_buf.store(ds16)
                fence_async_shared()
                gl.thread_barrier()
                if SPLIT_D:
                    mbarrier.arrive(ds_ready.index(0), count=1)
                    mbarrier.wait(ds_ready.index(0), cnt & 1)
                if LEAN:  # dK and dV complete first (see LEAN); Q and dO are then free
                    dk, dv = warpgroup_mma_wait(num_outstanding=0, deps=(dk, dv))
                    mbarrier.arrive(q_empty.index(buf), count=1)
                    mbarrier.arrive(do_empty.index(buf), count=1)
                if DETERMINISTIC:
                    # This consumer's DQ_COLS columns go to the dQ writer in chunks of
                    # DQ_CHUNK through its ring of staging buffers; the writer takes the
                    # turns and adds them. Chunk c + 1's product runs while chunk c is staged.
                    dq = _dq_chunk(ds_smem, 0, ds_buf, k_smem, cid, 0, BLOCK_M, DQ_COLS, DQ_CHUNK,
                                   CONSUMERS, SPLIT_D, dq_layout, DQ_LAYOUT == 3)
                    if not LEAN:
                        dq, dk, dv = warpgroup_mma_wait(num_outstanding=0, deps=(dq, dk, dv))
                        mbarrier.arrive(q_empty.index(buf), count=1)
                        mbarrier.arrive(do_empty.index(buf), count=1)
                    for c in gl.static_range(DQ_COLS // DQ_CHUNK):
                        dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq, ))
                        if c + 1 == DQ_COLS // DQ_CHUNK:
                            if SPLIT_D:
                                mbarrier.arrive(ds_free.index(0), count=1)
                        slot = (cnt * (DQ_COLS // DQ_CHUNK) + c) % DQ_RING
                        lap = (cnt * (DQ_COLS // DQ_CHUNK) + c) // DQ_RING
                        mbarrier.wait(dq_empty.index(cid * DQ_RING + slot), (lap & 1) ^ 1)
                        if DQ_LAYOUT >= 2:
                            dq_smem.index(cid * DQ_RING + slot).store(_fragments(dq))
                        elif DQ_LAYOUT == 1:
                            dq_smem.index(cid * DQ_RING + slot).store(_grouped(dq))
                        else:
                            dq_smem.index(cid * DQ_RING + slot).store(dq)
                        fence_async_shared()
                        gl.thread_barrier()
                        if c + 1 < DQ_COLS // DQ_CHUNK:
                            dq = _dq_chunk(ds_smem, 0, ds_buf, k_smem, cid, c + 1, BLOCK_M, DQ_COLS,
                                           DQ_CHUNK, CONSUMERS, SPLIT_D, dq_layout,
                                           DQ_LAYOUT == 3)
                        mbarrier.arrive(dq_full.index(cid * DQ_RING + slot), count=1)
                else:
                    dq = warpgroup_mma(ds_buf.permute((1, 0)), k,
                                       gl.zeros([BLOCK_M, D], gl.float32, layout=dq_layout),
                                       use_acc=False, is_async=True)
                    if LEAN:
                        dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq, ))
                    else:
                        dq, dk, dv = warpgroup_mma_wait(num_outstanding=0, deps=(dq, dk, dv))
                        mbarrier.arrive(q_empty.index(buf), count=1)
                        mbarrier.arrive(do_empty.index(buf), count=1)
                    # Through shared memory as one bulk reduction; the previous one must have
                    # finished reading the buffer first.
                    dq_buf = dq_smem.index(cid)
                    tma.store_wait(0)
                    gl.thread_barrier()
                    if DQ_LAYOUT == 2:
                        dq_buf.store(_fragments(dq))
                        fence_async_shared()
                        gl.thread_barrier()
                        _tma_reduce_add(desc_dq,
                                        [b * heads_q + hk * GQA + g, start // BLOCK_M, 0, 0],
                                        dq_buf._reinterpret(gl.float32,
                                                            [1, 1, BLOCK_M * D // 256, 256],
                                                            desc_dq.layout))
                    else:
                        dq_buf.store(dq)
                        fence_async_shared()
                        gl.thread_barrier()
                        _tma_reduce_add(desc_dq, [b, hk * GQA + g, start, 0],
                                        dq_buf._reinterpret(gl.float32, [1, 1, BLOCK_M, D],
                                                            desc_dq.layout))
            cnt += 1
    if DEFER:
        if cnt > cnt0:
            _dq_stage(cnt - 1, cid, ds_smem, k_smem, dq_smem, ds_ready, ds_free, dq_full,
                      dq_empty, BLOCK_M, DQ_COLS, DQ_CHUNK, CONSUMERS, DQ_RING, dq_layout,
                      DQ_LAYOUT)
    tma.store_wait(0)
    if DKDV_TMA:
        _store_dkdv(cid, k_smem, v_smem, kv_empty, kv_done, DK, DV, dk, dv, b, hk, n0, j,
                    CONSUMERS, D, DETERMINISTIC, PERSIST)
    else:
        if PERSIST:
            mbarrier.arrive(kv_empty, count=1)  # K and V are free for the next head's

        rows_k = n0 + cid * 64 + gl.arange(0, 64, layout=row_a)
        dq_cols = gl.arange(0, D, layout=col_a)
        ok = (rows_k < seq_k)[:, None]
        rows64 = rows_k.to(gl.int64)[:, None]
        b64 = b.to(gl.int64)
        hk64 = hk.to(gl.int64)
        gl.store(DK + b64 * stride_dkb + hk64 * stride_dkh + rows64 * stride_dkn
                 + dq_cols[None, :], dk.to(dtype), mask=ok)
        gl.store(DV + b64 * stride_dvb + hk64 * stride_dvh + rows64 * stride_dvn
                 + dq_cols[None, :], dv.to(dtype), mask=ok)
    return cnt


@gluon.jit
def _store_dkdv(cid: gl.constexpr, k_smem, v_smem, kv_empty, kv_done, desc_dk, desc_dv, dk, dv,
                b, hk, n0, j, CONSUMERS: gl.constexpr, D: gl.constexpr,
                DETERMINISTIC: gl.constexpr, PERSIST: gl.constexpr):
    """``hopper_dkdv_tma``: consumer ``cid``'s dK and dV rows, cast, staged in its own K and V
    tiles (whose products are all done) and stored with TMA, as FA3 does; rows past the
    keys' end are clipped by the descriptors. The register stores (each thread's 4-byte
    pieces of 64 rows, and their 64-bit addresses) took about a fifth of a 512-key call at
    D=128 (H200, session 56: ``benchmarks/experiments/bwd_ablate.py``'s ``nodkdv``)."""
    dtype: gl.constexpr = k_smem.dtype
    v_smem.index(cid).store(dv.to(dtype))  # V is read by this consumer's products only
    if DETERMINISTIC and CONSUMERS == 2:
        # Each consumer's dQ columns were computed from both K tiles: meet before either
        # is overwritten (the ``j``-th use of the barrier in a persistent program).
        mbarrier.arrive(kv_done, count=1)
        mbarrier.wait(kv_done, j & 1)
    k_smem.index(cid).store(dk.to(dtype))
    fence_async_shared()
    gl.thread_barrier()
    row = n0 + cid * 64
    tma.async_copy_shared_to_global(
        desc_dk, [b, hk, row, 0], k_smem.index(cid)._reinterpret(dtype, [1, 1, 64, D],
                                                                  desc_dk.layout))
    tma.async_copy_shared_to_global(
        desc_dv, [b, hk, row, 0], v_smem.index(cid)._reinterpret(dtype, [1, 1, 64, D],
                                                                  desc_dv.layout))
    tma.store_wait(0)  # the tiles are read: K and V may be loaded again (or the program end)
    if PERSIST:
        mbarrier.arrive(kv_empty, count=1)


@gluon.jit
def _attn_bwd_hopper_kernel(
    desc_q, desc_do, desc_k, desc_v, LSE, Delta, desc_dq, DK, DV, Sem,
    stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
    heads_kv, seq_q, seq_k, left, right, n_m,
    sm_scale, qk_scale, cap_scale, cap_log2,
    GQA: gl.constexpr, WALK: gl.constexpr, CONSUMERS: gl.constexpr, BLOCK_M: gl.constexpr,
    STAGES: gl.constexpr,
    ORDER: gl.constexpr, MASK_LEFT: gl.constexpr, MASK_RIGHT: gl.constexpr, SOFTCAP: gl.constexpr,
    DETERMINISTIC: gl.constexpr, CONSUMER_REGS: gl.constexpr, DQ_RING: gl.constexpr,
    DS_BUFS: gl.constexpr, STAGE_LSE: gl.constexpr, DQ_LAYOUT: gl.constexpr,
    KV_REGS: gl.constexpr, STORE_FIRST: gl.constexpr, PERSIST: gl.constexpr,
    DKDV_TMA: gl.constexpr, KV_REP: gl.constexpr, TURNS: gl.constexpr,
):
    gl.static_assert(CONSUMERS == 1 or CONSUMERS == 2)
    gl.static_assert(TURNS or STORE_FIRST == 0)  # (a first turn needs the turns)
    D: gl.constexpr = desc_q.block_type.shape[3]
    dtype: gl.constexpr = desc_q.dtype
    offset = seq_k - seq_q  # bottom-right alignment of the causal / window diagonal
    q_layout: gl.constexpr = gl.NVMMASharedLayout(desc_q.layout.swizzle_byte_width, 16)
    kv_layout: gl.constexpr = gl.NVMMASharedLayout(desc_k.layout.swizzle_byte_width, 16)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, BLOCK_M], dtype)
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, D], q_layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, D], q_layout)
    k_smem = gl.allocate_shared_memory(dtype, [CONSUMERS, 64, D], kv_layout)
    v_smem = gl.allocate_shared_memory(dtype, [CONSUMERS, 64, D], kv_layout)
    ds_smem = gl.allocate_shared_memory(dtype, [DS_BUFS * CONSUMERS, 64, BLOCK_M], ds_layout)
    # With STAGE_LSE, LSE and Δ (fp32 rows, TMA-loaded through (B*Hq, Sq) descriptors into
    # rank-1 buffers) come with each stage's Q and dO; else the consumers load them (unused).
    ROW_STAGES: gl.constexpr = STAGES if STAGE_LSE else 1
    ROW_LEN: gl.constexpr = BLOCK_M if STAGE_LSE else 16
    row_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32,
                                                    rank=1)
    lse_smem = gl.allocate_shared_memory(gl.float32, [ROW_STAGES, ROW_LEN], row_layout)
    delta_smem = gl.allocate_shared_memory(gl.float32, [ROW_STAGES, ROW_LEN], row_layout)
    # The fp32 dQ staging buffers for the TMA reduce-adds. The free order: each consumer's
    # whole tile. The fixed order: a ring of DQ_RING chunks of DQ_CHUNK columns (desc_dq's
    # box) per consumer, as deep as shared memory allows (the host's _smem_plan), between
    # the consumers and the dQ writer.
    DQ_BUFS: gl.constexpr = CONSUMERS * DQ_RING if DETERMINISTIC else CONSUMERS
    if DQ_LAYOUT >= 2:  # tiles or chunks in the accumulator's register order (see _fragments)
        dq_smem = gl.allocate_shared_memory(
            gl.float32, [DQ_BUFS, desc_dq.block_type.shape[2], 256],
            gl.NVMMASharedLayout(0, 32))
    elif DQ_LAYOUT == 1:  # the fixed order's chunks in column groups of eight (see _grouped)
        dq_smem = gl.allocate_shared_memory(
            gl.float32, [DQ_BUFS, desc_dq.block_type.shape[2], BLOCK_M, 8],
            gl.NVMMASharedLayout(desc_dq.layout.swizzle_byte_width, 32, rank=3))
    else:
        dq_layout: gl.constexpr = gl.NVMMASharedLayout(desc_dq.layout.swizzle_byte_width, 32)
        dq_smem = gl.allocate_shared_memory(gl.float32, [DQ_BUFS, BLOCK_M,
                                                         desc_dq.block_type.shape[3]], dq_layout)
    dq_full = gl.allocate_shared_memory(gl.int64, [DQ_BUFS, 1], mbarrier.MBarrierLayout())
    dq_empty = gl.allocate_shared_memory(gl.int64, [DQ_BUFS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(DQ_BUFS):
        mbarrier.init(dq_full.index(i), count=1)
        mbarrier.init(dq_empty.index(i), count=1)
    ds_ready = gl.allocate_shared_memory(gl.int64, [DS_BUFS, 1], mbarrier.MBarrierLayout())
    ds_free = gl.allocate_shared_memory(gl.int64, [DS_BUFS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(DS_BUFS):
        mbarrier.init(ds_ready.index(i), count=CONSUMERS)
        mbarrier.init(ds_free.index(i), count=CONSUMERS)
    kv_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    do_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    do_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_ready, count=1)
    if PERSIST:  # the consumers release K and V for the next head's (persistent_heads)
        kv_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(kv_empty, count=CONSUMERS)
    else:
        kv_empty = kv_ready  # unused
    if DKDV_TMA and DETERMINISTIC and CONSUMERS == 2:
        # The consumers meet before dK overwrites their K tiles (each one's dQ columns read
        # both K tiles in the fixed order).
        kv_done = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(kv_done, count=CONSUMERS)
    else:
        kv_done = kv_ready  # unused
    for i in gl.static_range(STAGES):
        mbarrier.init(q_full.index(i), count=1)
        mbarrier.init(do_full.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=CONSUMERS)
        mbarrier.init(do_empty.index(i), count=CONSUMERS)

    # Partitions. The free order: the producer in the kernel's own four warps, a warpgroup
    # per consumer. The fixed order adds a one-warp dQ writer per consumer; so that the
    # consumers keep their registers (the producer already runs at Triton's floor of 24),
    # consumer 0 runs in the kernel's warps and the producer and the writers share one
    # padded warpgroup at 24 registers each. Written out per case: Triton 3.6 traces the
    # partition lists as literals.
    if DETERMINISTIC:
        if CONSUMERS == 2:
            gl.warp_specialize([
                (_bwd_consumer, (0, q_smem, do_smem, k_smem, v_smem, ds_smem, dq_smem, lse_smem,
                                 delta_smem, kv_ready, kv_empty, kv_done,
                                 q_full, q_empty, do_full, do_empty, ds_ready, ds_free, dq_full,
                                 dq_empty, LSE, Delta, desc_dq, DK, DV,
                                 stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh,
                                 stride_dvn, heads_kv, seq_q, seq_k, offset, left, right, n_m,
                                 sm_scale, qk_scale, cap_scale, cap_log2, GQA, WALK, CONSUMERS,
                                 BLOCK_M, D, STAGES, ORDER, MASK_LEFT, MASK_RIGHT, SOFTCAP,
                                 DETERMINISTIC, DQ_RING, DS_BUFS, STAGE_LSE, DQ_LAYOUT, KV_REGS,
                                 PERSIST, DKDV_TMA)),
                (_bwd_consumer, (1, q_smem, do_smem, k_smem, v_smem, ds_smem, dq_smem, lse_smem,
                                 delta_smem, kv_ready, kv_empty, kv_done,
                                 q_full, q_empty, do_full, do_empty, ds_ready, ds_free, dq_full,
                                 dq_empty, LSE, Delta, desc_dq, DK, DV,
                                 stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh,
                                 stride_dvn, heads_kv, seq_q, seq_k, offset, left, right, n_m,
                                 sm_scale, qk_scale, cap_scale, cap_log2, GQA, WALK, CONSUMERS,
                                 BLOCK_M, D, STAGES, ORDER, MASK_LEFT, MASK_RIGHT, SOFTCAP,
                                 DETERMINISTIC, DQ_RING, DS_BUFS, STAGE_LSE, DQ_LAYOUT, KV_REGS,
                                 PERSIST, DKDV_TMA)),
                (_bwd_producer, (desc_q, desc_do, desc_k, desc_v, LSE, Delta, q_smem, do_smem,
                                 k_smem, v_smem, lse_smem, delta_smem,
                                 kv_ready, kv_empty, q_full, q_empty, do_full, do_empty,
                                 heads_kv, seq_q, offset, left, right, n_m,
                                 GQA, WALK, CONSUMERS, BLOCK_M, STAGES, ORDER, MASK_LEFT,
                                 MASK_RIGHT, STAGE_LSE, PERSIST, KV_REP)),
                (_bwd_dq_writer, (0, desc_dq, dq_smem, dq_full, dq_empty, Sem, heads_kv, seq_q,
                                  seq_k, offset, left, right, n_m, GQA, WALK, CONSUMERS, BLOCK_M, D,
                                  ORDER, MASK_LEFT, MASK_RIGHT, DQ_RING, DQ_LAYOUT,
                                  STORE_FIRST, PERSIST, TURNS)),
                (_bwd_dq_writer, (1, desc_dq, dq_smem, dq_full, dq_empty, Sem, heads_kv, seq_q,
                                  seq_k, offset, left, right, n_m, GQA, WALK, CONSUMERS, BLOCK_M, D,
                                  ORDER, MASK_LEFT, MASK_RIGHT, DQ_RING, DQ_LAYOUT,
                                  STORE_FIRST, PERSIST, TURNS)),
            ], [4, 1, 1, 1], [CONSUMER_REGS, 24, 24, 24])
        else:
            gl.warp_specialize([
                (_bwd_consumer, (0, q_smem, do_smem, k_smem, v_smem, ds_smem, dq_smem, lse_smem,
                                 delta_smem, kv_ready, kv_empty, kv_done,
                                 q_full, q_empty, do_full, do_empty, ds_ready, ds_free, dq_full,
                                 dq_empty, LSE, Delta, desc_dq, DK, DV,
                                 stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh,
                                 stride_dvn, heads_kv, seq_q, seq_k, offset, left, right, n_m,
                                 sm_scale, qk_scale, cap_scale, cap_log2, GQA, WALK, CONSUMERS,
                                 BLOCK_M, D, STAGES, ORDER, MASK_LEFT, MASK_RIGHT, SOFTCAP,
                                 DETERMINISTIC, DQ_RING, DS_BUFS, STAGE_LSE, DQ_LAYOUT, KV_REGS,
                                 PERSIST, DKDV_TMA)),
                (_bwd_producer, (desc_q, desc_do, desc_k, desc_v, LSE, Delta, q_smem, do_smem,
                                 k_smem, v_smem, lse_smem, delta_smem,
                                 kv_ready, kv_empty, q_full, q_empty, do_full, do_empty,
                                 heads_kv, seq_q, offset, left, right, n_m,
                                 GQA, WALK, CONSUMERS, BLOCK_M, STAGES, ORDER, MASK_LEFT,
                                 MASK_RIGHT, STAGE_LSE, PERSIST, KV_REP)),
                (_bwd_dq_writer, (0, desc_dq, dq_smem, dq_full, dq_empty, Sem, heads_kv, seq_q,
                                  seq_k, offset, left, right, n_m, GQA, WALK, CONSUMERS, BLOCK_M, D,
                                  ORDER, MASK_LEFT, MASK_RIGHT, DQ_RING, DQ_LAYOUT,
                                  STORE_FIRST, PERSIST, TURNS)),
            ], [1, 1], [24, 24])
    elif CONSUMERS == 2:
        gl.warp_specialize([
            (_bwd_producer, (desc_q, desc_do, desc_k, desc_v, LSE, Delta, q_smem, do_smem,
                             k_smem, v_smem, lse_smem, delta_smem,
                             kv_ready, kv_empty, q_full, q_empty, do_full, do_empty,
                             heads_kv, seq_q, offset, left, right, n_m,
                             GQA, WALK, CONSUMERS, BLOCK_M, STAGES, ORDER, MASK_LEFT, MASK_RIGHT,
                             STAGE_LSE, PERSIST, KV_REP)),
            (_bwd_consumer, (0, q_smem, do_smem, k_smem, v_smem, ds_smem, dq_smem, lse_smem,
                             delta_smem, kv_ready, kv_empty, kv_done,
                             q_full, q_empty, do_full, do_empty, ds_ready, ds_free, dq_full,
                             dq_empty, LSE, Delta, desc_dq, DK, DV,
                             stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh,
                             stride_dvn, heads_kv, seq_q, seq_k, offset, left, right, n_m,
                             sm_scale, qk_scale, cap_scale, cap_log2, GQA, WALK, CONSUMERS, BLOCK_M,
                             D, STAGES, ORDER, MASK_LEFT, MASK_RIGHT, SOFTCAP,
                             DETERMINISTIC, DQ_RING, DS_BUFS, STAGE_LSE, DQ_LAYOUT, KV_REGS,
                             PERSIST, DKDV_TMA)),
            (_bwd_consumer, (1, q_smem, do_smem, k_smem, v_smem, ds_smem, dq_smem, lse_smem,
                             delta_smem, kv_ready, kv_empty, kv_done,
                             q_full, q_empty, do_full, do_empty, ds_ready, ds_free, dq_full,
                             dq_empty, LSE, Delta, desc_dq, DK, DV,
                             stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh,
                             stride_dvn, heads_kv, seq_q, seq_k, offset, left, right, n_m,
                             sm_scale, qk_scale, cap_scale, cap_log2, GQA, WALK, CONSUMERS, BLOCK_M,
                             D, STAGES, ORDER, MASK_LEFT, MASK_RIGHT, SOFTCAP,
                             DETERMINISTIC, DQ_RING, DS_BUFS, STAGE_LSE, DQ_LAYOUT, KV_REGS,
                             PERSIST, DKDV_TMA)),
        ], [4, 4], [CONSUMER_REGS, CONSUMER_REGS])
    else:
        gl.warp_specialize([
            (_bwd_producer, (desc_q, desc_do, desc_k, desc_v, LSE, Delta, q_smem, do_smem,
                             k_smem, v_smem, lse_smem, delta_smem,
                             kv_ready, kv_empty, q_full, q_empty, do_full, do_empty,
                             heads_kv, seq_q, offset, left, right, n_m,
                             GQA, WALK, CONSUMERS, BLOCK_M, STAGES, ORDER, MASK_LEFT, MASK_RIGHT,
                             STAGE_LSE, PERSIST, KV_REP)),
            (_bwd_consumer, (0, q_smem, do_smem, k_smem, v_smem, ds_smem, dq_smem, lse_smem,
                             delta_smem, kv_ready, kv_empty, kv_done,
                             q_full, q_empty, do_full, do_empty, ds_ready, ds_free, dq_full,
                             dq_empty, LSE, Delta, desc_dq, DK, DV,
                             stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh,
                             stride_dvn, heads_kv, seq_q, seq_k, offset, left, right, n_m,
                             sm_scale, qk_scale, cap_scale, cap_log2, GQA, WALK, CONSUMERS, BLOCK_M,
                             D, STAGES, ORDER, MASK_LEFT, MASK_RIGHT, SOFTCAP,
                             DETERMINISTIC, DQ_RING, DS_BUFS, STAGE_LSE, DQ_LAYOUT, KV_REGS,
                             PERSIST, DKDV_TMA)),
        ], [4], [CONSUMER_REGS])


@triton.jit
def _dq_finish_fragments(
    DQA, DQ, stride_dqb, stride_dqh, stride_dqm, stride_dqd, heads_q, seq_q, n_m,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr,
):
    """dQ of one query tile from the fp32 accumulator kept in fragment order
    (``hopper_dq_frag``): the tile's HEAD_DIM / CHUNK blocks of BLOCK_M * CHUNK values, each
    in the order _fragments lays it out, cast to dQ's dtype."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    off_b = (pid_bh // heads_q).to(tl.int64)
    off_h = (pid_bh % heads_q).to(tl.int64)
    r = tl.arange(0, BLOCK_M)
    c = tl.arange(0, HEAD_DIM)
    # Row r = 64 blk + 16 w + 8 h + a and column 8 j + 2 e' + e of a chunk are value
    # 4 (128 k + t) + i of its block, with k = blk * CHUNK / 8 + j, t = 32 w + 4 a + e',
    # i = 2 h + e.
    row_at = (r // 64) * (CHUNK // 8) * 512 + ((r // 16) % 4) * 128 + (r % 8) * 16 \
        + ((r // 8) % 2) * 2
    cc = c % CHUNK
    col_at = (c // CHUNK) * (BLOCK_M * CHUNK) + (cc // 8) * 512 + ((cc % 8) // 2) * 4 + cc % 2
    block = (pid_bh.to(tl.int64) * n_m + pid_m) * (BLOCK_M * HEAD_DIM)
    rows = pid_m * BLOCK_M + r
    acc = tl.load(DQA + block + row_at[:, None] + col_at[None, :], mask=(rows < seq_q)[:, None],
                  other=0.0)
    tl.store(DQ + off_b * stride_dqb + off_h * stride_dqh + rows[:, None] * stride_dqm
             + c[None, :] * stride_dqd, acc.to(DQ.dtype.element_ty), mask=(rows < seq_q)[:, None])


# ----------------------------------------------------------------------------- host side

DQ_CHUNK = 32  # the fixed order's dQ columns per staging buffer (128 bytes of fp32: a swizzle row)
# With hopper_dq_groups=1 (column groups of eight, see _grouped) a chunk need not be one
# swizzle row: up to DQ_GROUPED_CHUNK columns, one chunk per consumer per query tile at
# D=128 (one fence, barrier and hand-off instead of two).
DQ_GROUPED_CHUNK = 64


def dq_chunk(c: BwdConfig, d: int, deterministic: bool) -> int:
    """The dQ columns of one staging buffer: the whole tile in the free order, else a chunk
    of DQ_CHUNK columns, or with ``hopper_dq_groups`` or ``hopper_dq_frag`` up to
    DQ_GROUPED_CHUNK (at most a consumer's share of D)."""
    if not deterministic:
        return d
    if c.hopper_dq_rows:  # each consumer's 64 rows of every column (see _dq_chunk)
        return min(DQ_GROUPED_CHUNK, d)
    if c.hopper_dq_groups or c.hopper_dq_frag:
        return min(DQ_GROUPED_CHUNK, d // (c.hopper_block_n // ROWS_PER_WG))
    return DQ_CHUNK


# Whether the fixed order with two consumers computes each tile's dQ columns one tile late,
# from a second dS slot, where shared memory has room for it (see _dq_stage).
DEFER_DQ = True


# Whether the producer stages LSE and Δ with each Q/dO stage, where shared memory has room
# (see _smem_plan); otherwise the consumers load them from global memory.
STAGE_LSE = True


class SmemPlan(NamedTuple):
    """What ``c``'s launch adds to the buffers the feasibility formula counts."""

    dq_ring: int  # the fixed order's staging chunks per consumer (1 in the free order)
    ds_bufs: int  # dS slots: 2 for the deferred dQ
    stage_lse: bool  # LSE and Δ come through shared memory with each stage


def _smem_plan(c: BwdConfig, d: int, deterministic: bool, masked: bool = False) -> SmemPlan:
    """How ``c`` spends the shared memory its feasibility formula leaves free, in order:
    - the LSE and Δ rows of every stage (``4 * BLOCK_M`` bytes each), where they fit
      beside what must be there (in the fixed order, one query tile's staging chunks);
    - the fixed order's staging ring between the consumers and the dQ writers: two query
      tiles' chunks where there is room, never fewer than one tile's;
    - a second dS slot, for the deferred dQ of two consumers in the fixed order.

    The ring must hold a whole query tile's chunks: a dQ writer frees a tile's buffers
    only once it has added all of them (``_bwd_dq_writer``), so with fewer the consumer
    waits for a buffer that the writer frees only after the chunk the consumer has yet to
    stage, and the kernel hangs. The feasibility formula does not count the ring; where
    one tile's chunks do not fit (four stages of 64 x 128 tiles at D=128, whose ring of one
    chunk hung in a 25 s H100 search; BENCHMARKS.md, session 31), this raises
    :class:`InfeasibleConfigError`.

    Not the deferral with 64-row query tiles under a mask: there it measured 3% slower at
    D=128 (H100, three causal shapes; BENCHMARKS.md, issue 13, session 28), since a later
    dQ hand-off also holds up the next key tile's turn, and masked walks are short."""
    base = smem_bwd_hopper(c, d, deterministic)
    rows = 2 * c.hopper_stages * c.hopper_block_m * 4
    if not deterministic:
        return SmemPlan(1, 1, STAGE_LSE and base + rows <= DEFAULT_SMEM_BYTES)
    consumers = c.hopper_block_n // ROWS_PER_WG
    chunk = dq_chunk(c, d, deterministic)
    # A consumer's chunks per query tile, and their staging buffers' bytes (all consumers):
    # of its D / consumers columns, or with hopper_dq_rows of its 64 rows.
    chunks = (d if c.hopper_dq_rows else d // consumers) // chunk
    entry = consumers * (ROWS_PER_WG if c.hopper_dq_rows else c.hopper_block_m) * chunk * 4
    stage_lse = STAGE_LSE and base + rows + chunks * entry <= DEFAULT_SMEM_BYTES
    if stage_lse:
        base += rows
    ring = min(2 * chunks, (DEFAULT_SMEM_BYTES - base) // entry)
    if ring < chunks:
        # Imported here: a line more at the top would move the kernels' line info in the PTX.
        from flashtune.exceptions import InfeasibleConfigError

        raise InfeasibleConfigError(
            f"bwd hopper: deterministic dQ needs {chunks} staging buffers of {entry} bytes "
            f"(a {c.hopper_block_m}-row query tile's fp32 dQ columns) beside the "
            f"{c.hopper_stages} Q/dO stages, and {max(DEFAULT_SMEM_BYTES - base, 0)} bytes of "
            f"shared memory are left; use fewer hopper_stages or a smaller tile")
    second_ds = 2 * c.hopper_block_n * c.hopper_block_m  # one more dS tile per consumer
    defer = DEFER_DQ and consumers == 2 and not (masked and c.hopper_block_m == 64)
    if defer and base + second_ds + ring * entry <= DEFAULT_SMEM_BYTES:
        return SmemPlan(ring, 2, stage_lse)
    return SmemPlan(ring, 1, stage_lse)



def unvisited_query_tiles(seq_q: int, seq_k: int, block_m: int, block_n: int, left: int,
                          right: int, mask_left: bool, mask_right: bool,
                          ) -> list[tuple[int, int]]:
    """The runs [a, z) of query tiles that no key tile's walk reaches (the kernel's own
    ranges, ``_kv_range`` from the key side): their rows see no key, their dQ is zero, and
    no turn stores it. Empty unless a mask leaves whole query tiles without keys (a causal
    diagonal with Sq > Sk, a window past the keys)."""
    n_m = -(-seq_q // block_m)
    seen = [0] * (n_m + 1)
    for n0 in range(0, seq_k, block_n):
        lo, _, _, hi = inner_range_host(n0, seq_q, seq_q - seq_k, right, left, block_n, block_m,
                                        mask_right, mask_left)
        if hi > lo:
            seen[lo // block_m] += 1
            seen[min(hi // block_m, n_m)] -= 1
    runs: list[tuple[int, int]] = []
    depth = 0
    for t in range(n_m):
        depth += seen[t]
        if depth == 0:
            if runs and runs[-1][1] == t:
                runs[-1] = (runs[-1][0], t + 1)
            else:
                runs.append((t, t + 1))
    return runs


def check_launch_plan(c: BwdConfig, head_dim: int, deterministic: bool) -> None:
    """Raise :class:`InfeasibleConfigError` where ``c`` passes the feasibility formula but
    its launch's buffers cannot be planned (:func:`_smem_plan`); the search space asks
    this before it proposes a config."""
    _smem_plan(c, head_dim, hopper_bwd_fixed_order(c, head_dim, deterministic))

def _template(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
              block: list[int], layout: Any) -> Any:
    """A descriptor template (``_bound.template``) over a contiguous tensor of ``shape`` that
    is allocated per call: the fp32 dQ accumulator, LSE and Δ."""
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * shape[i + 1]
    base = torch.empty(1, device=device, dtype=dtype)  # aligned: only its dtype is read
    return template(TensorDescriptor(base, list(shape), strides, block, layout))


class _Launch:
    """What the two prepared forms share: a call allocates its buffers (:meth:`buffers`)
    and launches into them (:meth:`run`), which the tuner times on buffers made once."""

    stage_lse: bool

    def _lse(self, lse: torch.Tensor) -> torch.Tensor:
        """The LSE made contiguous, and 16-byte aligned where it is staged (TMA needs it;
        a fresh allocation is)."""
        lse = lse.contiguous()
        return lse.clone() if self.stage_lse and lse.data_ptr() % 16 else lse

    def __call__(self, do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 o: torch.Tensor, lse: torch.Tensor,
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """dQ, dK and dV."""
        bufs = self.buffers(q, k, v, lse)
        self.run(do, q, k, v, o, bufs)
        return bufs[0], bufs[1], bufs[2]


class HopperBwdLaunch(_Launch):
    """The Gluon backward for one call signature (shapes and strides of q, k, v, o and dO,
    dtype, device, mask, config, determinism), prepared once as ``HopperLaunch`` prepares
    the forward: grids, scalars, constexprs, descriptor templates and three bound launches
    (``flashtune.kernels._bound``) - the delta preprocess (which also zeroes the fp32 dQ
    accumulator, but in fragment order: see :meth:`run`), the Gluon backward and the dQ
    cast. Built per call instead (plans, seven
    descriptors, three ``kernel[grid]`` launches), it kept the GPU waiting on short
    problems, and eager training steps timed the host (session 30, BENCHMARKS.md).

    ``mask`` is (left, right, MASK_LEFT, MASK_RIGHT) and ``scales`` (qk_scale, cap_scale,
    cap_log2), as the portable launcher computes them. The caller has checked
    feasibility and that TMA can describe q, k, v and do; tensors of the same signature
    with 16-byte aligned data are served (:meth:`buffers`, then :meth:`run`)."""

    def __init__(self, do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 o: torch.Tensor, *, sm_scale: float, mask: tuple[int, int, bool, bool],
                 scales: tuple[float, float, float], softcap: float, config: BwdConfig,
                 deterministic: bool,
                 grads: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> None:
        c = config
        b, hq, sq, d = q.shape
        hk, sk = k.shape[1], k.shape[2]
        # hopper_kv_rep: r virtual KV heads per KV head, each with GQA / r of its query
        # heads; from here on hk counts virtual heads (the producer loads K and V of
        # hk // r), and dK and dV go to a partial per virtual head (see run).
        self.kv_rep = c.hopper_kv_rep
        hk *= self.kv_rep
        left, right, mask_left, mask_right = mask
        qk_scale, cap_scale, cap_log2 = scales
        m, n = c.hopper_block_m, c.hopper_block_n
        # hopper_dq_unordered: a free-order call in the fixed order's staging, without its
        # turns (the feasibility rules allow it only there).
        unordered = bool(c.hopper_dq_unordered) and not deterministic
        # A free-order call whose staging does not fit runs in the fixed order.
        deterministic = hopper_bwd_fixed_order(c, d, deterministic)
        self.turns = deterministic and not unordered
        n_m = triton.cdiv(sq, m)
        n_n = triton.cdiv(sk, n)
        # The order of dQ turns (see _dq_turn). A program waits only for programs launched
        # before it, except in the cyclic order (ORDER 2), where the first programs of a
        # head wait for its last: there every key tile of a head must be resident at once,
        # which half the SMs guarantee with room to spare. Without turns a masked call
        # launches each head's heaviest key tile first (ORDER 0), so that no heavy program
        # starts at the grid's end.
        if mask_left or mask_right:
            order = 1 if self.turns else 0
        elif self.turns:
            order = 2 if n_n <= _sm_count(q.device.index or 0) // 2 else 0
        else:
            order = 2 if c.hopper_stagger else 0
        consumers = n // ROWS_PER_WG
        self.deterministic = deterministic
        self.acc_shape = (b, hq, sq, d)
        self.sem_shape = (b * hq, n_m, consumers)
        plan = _smem_plan(c, d, deterministic, mask_left or mask_right)
        # LSE and Δ through shared memory where there is room and TMA can describe them
        # (the LSE must then be 16-byte aligned: see buffers).
        self.stage_lse = plan.stage_lse and sq % 4 == 0
        # The fixed order stages dQ in chunks (see the kernel), the free order whole; with
        # column groups (fixed order only) the accumulator is seen as [b, hq, d / 8, sq, 8].
        dq_cols = dq_chunk(c, d, deterministic)
        groups = bool(c.hopper_dq_groups) and deterministic
        self.frag = bool(c.hopper_dq_frag)
        dq_rows = bool(c.hopper_dq_rows) and deterministic and self.frag
        # The accumulator's blocks to zero per call: all of them, or with
        # hopper_dq_store_first (fixed order, frag) only those of query tiles no key tile
        # visits: the first turn of every other tile stores its dQ (see _bwd_dq_writer).
        self.zero_blocks: list[tuple[int, int]] | None = None
        # (1: the writer branches on the turn; 2: it issues both TMA ops, see _bwd_dq_writer)
        store_first = c.hopper_dq_store_first if self.frag and self.turns else 0
        if store_first:
            per_tile = d // dq_cols
            self.zero_blocks = [(a * per_tile, z * per_tile) for a, z in unvisited_query_tiles(
                sq, sk, m, n, left, right, mask_left, mask_right)]
        if self.frag:
            # Each (query tile, column chunk) is a contiguous block of m * dq_cols values in
            # the consumers' register order (see _fragments), a padded last tile included,
            # put back in rows by _dq_finish_fragments.
            # With hopper_dq_rows a writer adds its consumer's 64 rows: half a block.
            rows = m * dq_cols // 256
            box = ROWS_PER_WG * dq_cols // 256 if dq_rows else rows
            self.acc_shape = (b * hq, n_m * (d // dq_cols), rows, 256)
            tacc = _template(self.acc_shape, torch.float32, q.device, [1, 1, box, 256],
                             gl.NVMMASharedLayout(0, 32, rank=4))
        elif groups:
            base = torch.empty(1, device=q.device, dtype=torch.float32)
            tacc = template(TensorDescriptor(
                base, [b, hq, d // 8, sq, 8], [hq * sq * d, sq * d, 8, d, 1],
                [1, 1, dq_cols // 8, m, 8], gl.NVMMASharedLayout(32, 32, rank=5)))
        else:
            tacc = _template(self.acc_shape, torch.float32, q.device, [1, 1, m, dq_cols],
                             gl.NVMMASharedLayout.get_default_for([1, 1, m, dq_cols], gl.float32))
        self.templates = (
            template(_descriptor(q, m)), template(_descriptor(do, m)),
            template(_descriptor(k, ROWS_PER_WG)), template(_descriptor(v, ROWS_PER_WG)), tacc)
        rows_layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
        self.rows = (_template((b * hq, sq), torch.float32, q.device, [1, m], rows_layout)
                     if self.stage_lse else None)
        self.pre = BoundLaunch(
            _attn_bwd_preprocess, (triton.cdiv(sq, c.pre_block_m), b * hq),
            [None] * 4 + [*o.stride(), *do.stride(), hq, sq],
            dict(HEAD_DIM=d, BLOCK_D=d, BLOCK_M=c.pre_block_m, ZERO_DQ=not self.frag), 4)
        # dQ, dK and dV are allocated per call like q, k and v: empty_like's strides (a
        # dense input's own, else contiguous ones), or those of ``grads`` (one half's views
        # of the whole call's gradients: SplitHopperBwdLaunch).
        dq0, dk0, dv0 = grads or (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
        dk_strides, dv_strides = [*dk0.stride()[:3]], [*dv0.stride()[:3]]
        if self.kv_rep > 1:  # the partials: contiguous (b, r * hk, sk, d)
            dk_strides = dv_strides = [hk * sk * d, sk * d, d]
        # hopper_dkdv_tma: dK and dV stored through descriptors over the gradients (their
        # strides are the signature's: empty_like of k and v, or views of the whole call's
        # gradients); where TMA cannot describe them, from registers (same values).
        self.dkdv = None
        if c.hopper_dkdv_tma and self.kv_rep > 1:
            part = _template((b, hk, sk, d), k.dtype, q.device, [1, 1, ROWS_PER_WG, d],
                             _smem_layout(ROWS_PER_WG, d, k.dtype))
            self.dkdv = (part, part)
        elif c.hopper_dkdv_tma and not tma_describable(dk0, dv0):
            self.dkdv = (template(_descriptor(dk0, ROWS_PER_WG)),
                         template(_descriptor(dv0, ROWS_PER_WG)))
        # hopper_persist (no mask): G programs per key tile, each walking heads g, g + G, ...
        persist = bool(c.hopper_persist) and not (mask_left or mask_right)
        slots = persistent_heads(n_n, b * hk, _sm_count(q.device.index or 0)) if persist \
            else b * hk
        self.main = BoundLaunch(
            _attn_bwd_hopper_kernel, (n_n, slots),
            [None] * 10 + [*dk_strides, *dv_strides, hk, sq, sk, left, right, n_m, sm_scale,
                           qk_scale, cap_scale, cap_log2],
            dict(GQA=hq // hk, WALK=c.hopper_walk, CONSUMERS=consumers, BLOCK_M=m,
                 STAGES=c.hopper_stages,
                 ORDER=order, MASK_LEFT=mask_left, MASK_RIGHT=mask_right,
                 SOFTCAP=softcap > 0.0, DETERMINISTIC=deterministic,
                 CONSUMER_REGS=c.hopper_regs, DQ_RING=plan.dq_ring, DS_BUFS=plan.ds_bufs,
                 STAGE_LSE=self.stage_lse,
                 DQ_LAYOUT=3 if dq_rows else 2 if self.frag else int(groups),
                 KV_REGS=bool(c.hopper_kv_regs), STORE_FIRST=store_first,
                 PERSIST=persist, DKDV_TMA=self.dkdv is not None, KV_REP=self.kv_rep,
                 TURNS=self.turns, num_warps=4), 10)
        # dS carried the softmax scale: the cast scales by 1.
        if self.frag:
            self.finish = BoundLaunch(
                _dq_finish_fragments, (n_m, b * hq), [None] * 2 + [*dq0.stride(), hq, sq, n_m],
                dict(HEAD_DIM=d, BLOCK_M=m, CHUNK=dq_cols, num_warps=4), 2)
        else:
            self.finish = BoundLaunch(
                _attn_bwd_dq_finish, (triton.cdiv(sq, 64), b * hq),
                [None] * 2 + [*dq0.stride(), hq, sq, 1.0],
                dict(HEAD_DIM=d, BLOCK_D=d, BLOCK_M=64, num_warps=4), 2)

    def buffers(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lse: torch.Tensor,
                ) -> tuple[torch.Tensor, ...]:
        """(dq, dk, dv, lse, delta, the fp32 dQ accumulator, the semaphores) for one call:
        the LSE made contiguous (and 16-byte aligned where it is staged), the rest new."""
        lse = self._lse(lse)
        return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), lse,
                torch.empty_like(lse), *self.scratch(q.device))

    def scratch(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(the fp32 dQ accumulator, the semaphores: the accumulator again where the adds
        take no turns, which need none), new."""
        dq_acc = torch.empty(self.acc_shape, device=device, dtype=torch.float32)
        sem = (torch.empty(self.sem_shape, device=device, dtype=torch.int32)
               if self.turns else dq_acc)
        return dq_acc, sem

    def run(self, do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            o: torch.Tensor, bufs: tuple[torch.Tensor, ...]) -> None:
        """Launch the three kernels into ``bufs`` (from :meth:`buffers`)."""
        dq, dk, dv, lse, delta, dq_acc, sem = bufs
        tq, tdo, tk, tv, tacc = self.templates
        if self.frag:
            # Zeroed here, not where it is allocated: the tuner times run() on buffers
            # made once, and must time (and repeat correctly) what every call does.
            if self.zero_blocks is None:
                dq_acc.zero_()
            else:
                for a, z in self.zero_blocks:
                    dq_acc[:, a:z].zero_()
        self.pre(o, do, delta, dq_acc)
        if self.turns:
            sem.zero_()
        rows = ((descriptor_like(self.rows, lse), descriptor_like(self.rows, delta))
                if self.rows is not None else (lse, delta))
        # hopper_kv_rep: each virtual KV head's dK and dV partial, summed afterwards in
        # fp32, in one order (the partials' index), into the call's dK and dV.
        parts = (dk, dv) if self.kv_rep == 1 else tuple(
            torch.empty(t.shape[0], t.shape[1] * self.kv_rep, *t.shape[2:], device=t.device,
                        dtype=t.dtype) for t in (dk, dv))
        grads = ((descriptor_like(self.dkdv[0], parts[0]),
                  descriptor_like(self.dkdv[1], parts[1]))
                 if self.dkdv is not None else parts)
        self.main(descriptor_like(tq, q), descriptor_like(tdo, do), descriptor_like(tk, k),
                  descriptor_like(tv, v), *rows, descriptor_like(tacc, dq_acc), *grads, sem)
        if self.kv_rep > 1:
            # One reduction per gradient, straight into it: torch sums bf16/fp16 in fp32
            # and rounds once, as a float32 sum and a cast would, without writing and
            # reading back an fp32 copy of dK and dV (twice their bytes, per call).
            for out, part in zip((dk, dv), parts, strict=True):
                b, hk, sk, d = out.shape
                torch.sum(part.view(b, hk, self.kv_rep, sk, d), dim=2, out=out)
        self.finish(dq_acc, dq)


def persistent_heads(n_n: int, heads: int, sms: int) -> int:
    """G, the programs per key tile of a ``hopper_persist`` launch over ``heads`` (batch x
    KV heads) of ``n_n`` key tiles each: as many whole heads as the SMs hold at once, so
    that every key tile of the G heads a round walks is resident together (the cyclic
    fixed order waits across a head's key tiles), at least one and at most ``heads``.
    Each program walks heads g, g + G, ...: a head's dependencies lie in its own round."""
    return max(1, min(heads, sms // n_n))


def split_plan(b: int, hq: int, hk: int, parts: int) -> list[tuple[slice, slice, slice]]:
    """(batch, query-head, KV-head) slices of the independent parts a call of ``b`` x
    ``hq`` query heads (``hk`` KV heads) runs as with ``hopper_split=parts``: halves of the
    batch where it has two sequences or more, else halves of the KV heads (each with its
    group's query heads), else the whole call. The first part is the smaller one."""
    whole = slice(0, None)
    if parts < 2 or b * hk < 2:
        return [(whole, whole, whole)]
    if b >= 2:
        return [(slice(i * b // 2, (i + 1) * b // 2), whole, whole) for i in range(2)]
    g = hq // hk
    return [(whole, slice(g * (i * hk // 2), g * ((i + 1) * hk // 2)),
             slice(i * hk // 2, (i + 1) * hk // 2)) for i in range(2)]


_SIDE_STREAMS: dict[int, Any] = {}


def _side_stream(device: torch.device) -> Any:
    """This device's side stream for the second part of a split backward (one per
    device, made once: creating streams per call costs host time)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SIDE_STREAMS:
        _SIDE_STREAMS[index] = torch.cuda.Stream(device=index)
    return _SIDE_STREAMS[index]


class SplitHopperBwdLaunch(_Launch):
    """:class:`HopperBwdLaunch` for ``hopper_split=2``: the call as two independent parts
    (:func:`split_plan`), each a HopperBwdLaunch of its own over views of the call's
    tensors, the first on the current stream, the second on a side stream that forks from
    it and joins back into it, so that one part's bandwidth-bound launches (accumulator
    zeroing, delta preprocess, dQ cast) overlap the other's main kernel.

    Each part sums every dQ tile in the same order as the whole call (a part is a set of
    whole heads), so the gradients are bit-identical. The main kernels run concurrently:
    where the fixed order is cyclic (ORDER 2), a head's key tiles wait for each other, and
    with two kernels in flight at most two heads are partly resident, which the cyclic
    order's bound (key tiles per head <= half the SMs) still leaves room for. The buffers
    are allocated on the current stream and the side stream's work joins back into it
    before they can be freed or read."""

    def __init__(self, do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 o: torch.Tensor, **kw: Any) -> None:
        b, hq = q.shape[:2]
        self.plan = split_plan(b, hq, k.shape[1], kw["config"].hopper_split)
        grads = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)  # layouts
        self.parts = [HopperBwdLaunch(*self._views(sl, do, q, k, v, o), **kw,
                                      grads=self._grads(sl, *grads))
                      for sl in self.plan]
        self.deterministic = self.parts[0].deterministic
        self.stage_lse = any(p.stage_lse for p in self.parts)
        self.side = _side_stream(q.device) if q.is_cuda else None

    @staticmethod
    def _views(sl: tuple[slice, slice, slice], do: torch.Tensor, q: torch.Tensor,
               k: torch.Tensor, v: torch.Tensor, o: torch.Tensor) -> tuple[torch.Tensor, ...]:
        bs, hs_q, hs_k = sl
        return do[bs, hs_q], q[bs, hs_q], k[bs, hs_k], v[bs, hs_k], o[bs, hs_q]

    @staticmethod
    def _grads(sl: tuple[slice, slice, slice], dq: torch.Tensor, dk: torch.Tensor,
               dv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        bs, hs_q, hs_k = sl
        return dq[bs, hs_q], dk[bs, hs_k], dv[bs, hs_k]

    def buffers(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lse: torch.Tensor,
                ) -> tuple[torch.Tensor, ...]:
        """(dq, dk, dv, lse, delta) of the whole call (as HopperBwdLaunch's), then each
        part's (fp32 dQ accumulator, semaphores)."""
        lse = self._lse(lse)
        out = [torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), lse,
               torch.empty_like(lse)]
        for part in self.parts:
            out += part.scratch(q.device)
        return tuple(out)

    def run(self, do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            o: torch.Tensor, bufs: tuple[torch.Tensor, ...]) -> None:
        """Launch both parts into ``bufs`` (from :meth:`buffers`)."""
        dq, dk, dv, lse, delta = bufs[:5]
        cur = None
        if self.side is not None:
            # The fork, before the first part's launches: waiting on the current stream
            # after them would run the parts one after the other.
            cur = torch.cuda.current_stream(q.device)
            self.side.wait_stream(cur)
        for i, (part, sl) in enumerate(zip(self.parts, self.plan, strict=True)):
            bs, hs_q, _ = sl
            do_, q_, k_, v_, o_ = self._views(sl, do, q, k, v, o)
            part_bufs = (*self._grads(sl, dq, dk, dv), lse[bs, hs_q], delta[bs, hs_q],
                         *bufs[5 + 2 * i:7 + 2 * i])
            if i == 0 or self.side is None:
                part.run(do_, q_, k_, v_, o_, part_bufs)
                continue
            with torch.cuda.stream(self.side):
                part.run(do_, q_, k_, v_, o_, part_bufs)
        if cur is not None:
            cur.wait_stream(self.side)


def prepare_hopper_bwd(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       o: torch.Tensor, **kw: Any) -> HopperBwdLaunch | SplitHopperBwdLaunch:
    """The prepared Gluon backward for one call signature: split in two
    (:class:`SplitHopperBwdLaunch`) where the config asks for it and the call has two
    sequences or two KV heads, else whole."""
    b, hq = q.shape[:2]
    if len(split_plan(b, hq, k.shape[1], kw["config"].hopper_split)) > 1:
        return SplitHopperBwdLaunch(do, q, k, v, o, **kw)
    return HopperBwdLaunch(do, q, k, v, o, **kw)


def hopper_bwd_launch(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      o: torch.Tensor, lse: torch.Tensor, *, sm_scale: float,
                      mask: tuple[int, int, bool, bool], scales: tuple[float, float, float],
                      softcap: float, config: BwdConfig, deterministic: bool,
                      ) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                                 Callable[[], None]]:
    """The (dq, dk, dv) buffers and one callable that fills them (a :class:`HopperBwdLaunch`
    with its buffers made once: what the tuner times)."""
    launch = prepare_hopper_bwd(do, q, k, v, o, sm_scale=sm_scale, mask=mask, scales=scales,
                                softcap=softcap, config=config, deterministic=deterministic)
    bufs = launch.buffers(q, k, v, lse)
    return (bufs[0], bufs[1], bufs[2]), lambda: launch.run(do, q, k, v, o, bufs)
