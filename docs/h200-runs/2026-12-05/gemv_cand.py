"""Candidate bf16 GEMV (12-05): y[M, N] = x[M, K] @ w[N, K]^T for decode-sized M, CUDA cores, no split-K."""
import torch
import triton
import triton.language as tl


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREFETCH: tl.constexpr,
                 EVICT: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.minimum(offs_n, N - 1).to(tl.int64)
    rm = tl.minimum(offs_m, M - 1).to(tl.int64)
    k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + (rn * stride_wn)[None, :, None] + k[None, None, :]  # [1, BN, BK]
    x_ptrs = x_ptr + (rm * stride_xm)[:, None, None] + k[None, None, :]  # [BM, 1, BK]
    acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    k_main = K // BLOCK_K * BLOCK_K
    if PREFETCH:
        w = tl.load(w_ptrs, mask=(k < k_main)[None, None, :], other=0.0)
        for k0 in range(0, k_main, BLOCK_K):
            x = tl.load(x_ptrs + k0)
            k_next = tl.minimum(k0 + BLOCK_K, k_main - BLOCK_K)
            w_next = tl.load(w_ptrs + k_next, eviction_policy=EVICT)
            acc = tl.fma(w.to(tl.float32), x.to(tl.float32), acc)
            w = w_next
    else:
        for k0 in range(0, k_main, BLOCK_K):
            x = tl.load(x_ptrs + k0)
            w = tl.load(w_ptrs + k0)
            acc = tl.fma(w.to(tl.float32), x.to(tl.float32), acc)
    if k_main < K:
        km = (k_main + k < K)[None, None, :]
        x = tl.load(x_ptrs + k_main, mask=km, other=0.0)
        w = tl.load(w_ptrs + k_main, mask=km, other=0.0)
        acc = tl.fma(w.to(tl.float32), x.to(tl.float32), acc)
    y = tl.sum(acc, axis=2)
    out = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out, y.to(out_ptr.dtype.element_ty), mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])


def gemv(x, w, block_n=4, block_k=2048, num_warps=4, prefetch=True, out=None, evict=""):
    M, K = x.shape
    N = w.shape[0]
    bm = min(triton.next_power_of_2(M), 4)
    bk = min(block_k, triton.next_power_of_2(K))
    if out is None:
        out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(N, block_n), triton.cdiv(M, bm))
    _gemv_kernel[grid](x, w, out, M, N, K, x.stride(0), w.stride(0), out.stride(0),
                       BLOCK_M=bm, BLOCK_N=block_n, BLOCK_K=bk, PREFETCH=prefetch, EVICT=evict, num_warps=num_warps)
    return out
