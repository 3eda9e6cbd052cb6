"""The backward's two small kernels every variant shares, the portable ones and the Gluon
one: the delta preprocess (which can also zero an fp32 dQ accumulator) and the cast of
that accumulator to dQ."""

import triton
import triton.language as tl


@triton.jit
def _attn_bwd_preprocess(
    O, DO, Delta, DQA,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_dob, stride_doh, stride_dom, stride_dod,
    heads_q, seq_q,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    ZERO_DQ: tl.constexpr,
):
    # delta[b, h, i] = sum_d dO[b, h, i, d] * O[b, h, i, d], in fp32. With ZERO_DQ, also
    # zero the same rows of the fp32 dQ accumulator (laid out as delta, BLOCK_D wide).
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    off_b = (pid_bh // heads_q).to(tl.int64)
    off_h = (pid_bh % heads_q).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_m[:, None] < seq_q) & (offs_d[None, :] < HEAD_DIM)
    o = tl.load(O + off_b * stride_ob + off_h * stride_oh + offs_m[:, None] * stride_om
                + offs_d[None, :] * stride_od, mask=mask, other=0.0)
    do = tl.load(DO + off_b * stride_dob + off_h * stride_doh + offs_m[:, None] * stride_dom
                 + offs_d[None, :] * stride_dod, mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    rows = pid_bh.to(tl.int64) * seq_q + offs_m
    tl.store(Delta + rows, delta, mask=offs_m < seq_q)
    if ZERO_DQ:
        tl.store(DQA + rows[:, None] * BLOCK_D + offs_d[None, :],
                 tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32), mask=offs_m[:, None] < seq_q)


@triton.jit
def _attn_bwd_dq_finish(
    DQA, DQ,
    stride_dqb, stride_dqh, stride_dqm, stride_dqd,
    heads_q, seq_q, sm_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
):
    # dQ = sm_scale * the fp32 accumulator (rows laid out as delta), cast to dQ's dtype.
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    off_b = (pid_bh // heads_q).to(tl.int64)
    off_h = (pid_bh % heads_q).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    rows = pid_bh.to(tl.int64) * seq_q + offs_m
    acc = tl.load(DQA + rows[:, None] * BLOCK_D + offs_d[None, :],
                  mask=offs_m[:, None] < seq_q, other=0.0)
    mask = (offs_m[:, None] < seq_q) & (offs_d[None, :] < HEAD_DIM)
    tl.store(DQ + off_b * stride_dqb + off_h * stride_dqh + offs_m[:, None] * stride_dqm
             + offs_d[None, :] * stride_dqd, (acc * sm_scale).to(DQ.dtype.element_ty),
             mask=mask)
