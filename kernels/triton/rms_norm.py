"""RMSNorm over the last dimension in Triton, alone and fused with the residual add.

    out[r, i] = x[r, i] / sqrt(mean(x[r, :]^2) + eps) * w[i]
    add_rms_norm: sum = x + residual (stored), out = rms_norm(sum) (of the stored sum).

One program per row with the whole row in registers (BLOCK >= dim), f32 accumulation.
The row is read once (evicted first), the weight stays in L2 (evicted last). The
specializations below are compiled ahead of time by `cargo xtask build-kernels`; they
assume 16-byte aligned buffers and a row length that is a multiple of 16, which the
kernel registry checks (`ShapeLimits::row_multiple`). Matches kpt_kernels::cpu::reference.
"""

import triton
import triton.language as tl


@triton.jit
def kpt_rms_norm(x_ptr, w_ptr, out_ptr, dim, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64) * dim
    cols = tl.arange(0, BLOCK)
    mask = cols < dim
    x = tl.load(x_ptr + row + cols, mask=mask, other=0.0, eviction_policy="evict_first")
    x = x.to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0, eviction_policy="evict_last")
    inv = tl.rsqrt(tl.sum(x * x, axis=0) / dim + eps)
    y = x * (inv * w.to(tl.float32))
    tl.store(out_ptr + row + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def kpt_add_rms_norm(x_ptr, res_ptr, w_ptr, sum_ptr, out_ptr, dim, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64) * dim
    cols = tl.arange(0, BLOCK)
    mask = cols < dim
    x = tl.load(x_ptr + row + cols, mask=mask, other=0.0, eviction_policy="evict_first")
    r = tl.load(res_ptr + row + cols, mask=mask, other=0.0, eviction_policy="evict_first")
    s = (x.to(tl.float32) + r.to(tl.float32)).to(sum_ptr.dtype.element_ty)
    tl.store(sum_ptr + row + cols, s, mask=mask)
    s = s.to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0, eviction_policy="evict_last")
    inv = tl.rsqrt(tl.sum(s * s, axis=0) / dim + eps)
    y = s * (inv * w.to(tl.float32))
    tl.store(out_ptr + row + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


DTYPES = {"f32": "fp32", "bf16": "bf16", "f16": "fp16"}
# Row block (a power of two >= the row length) -> warps per program.
BLOCKS = {1024: 4, 2048: 8, 4096: 8, 8192: 16}


def kpt_entry_points():
    """Every specialization: artifact name, function, argument types, constants, warps.

    Pointers and the row length carry a divisibility-by-16 hint (`:16`).
    """
    out = []
    for name, ty in DTYPES.items():
        for block, warps in BLOCKS.items():
            out.append({
                "kernel": f"triton_rms_norm_{name}_{block}",
                "fn": kpt_rms_norm,
                "signature": [f"*{ty}:16", f"*{ty}:16", f"*{ty}:16", "i32:16", "fp32"],
                "constexprs": {"BLOCK": block},
                "num_warps": warps,
                "grid": "rows",
            })
            out.append({
                "kernel": f"triton_add_rms_norm_{name}_{block}",
                "fn": kpt_add_rms_norm,
                "signature": [f"*{ty}:16"] * 5 + ["i32:16", "fp32"],
                "constexprs": {"BLOCK": block},
                "num_warps": warps,
                "grid": "rows",
            })
    return out
