"""PyTorch side of kpt's CUDA side-by-side benchmark (`kpt-bench-cuda`).

Protocol: one JSON object per line on stdin, one JSON reply per line on stdout. The
first reply (before any request) describes the environment. Each request names a case,
its shape, and how many back-to-back calls one timed repetition holds (`inner`) and how
many repetitions to take (`reps`); the reply holds the per-call seconds of every
repetition of every variant. Timing is the same as on the kpt side: CUDA events around
`inner` calls on the current stream, after warm-up calls (which also compile).
Consecutive requests for the same case reuse its inputs and compiled functions, so the
caller can interleave single repetitions with its own. `KPT_SDPA_BACKENDS` (set by
`kpt-bench-cuda --sdpa`), comma-separated flash, cudnn, efficient: time only those SDPA
backends (default all three).
"""

import json
import os
import subprocess
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}


def rand(shape, dtype, lo=-1.0, hi=1.0):
    return (torch.rand(shape, device="cuda") * (hi - lo) + lo).to(dtype)


def compiled(fn):
    return torch.compile(fn, dynamic=False)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


SDPA_ONLY = {b for b in os.environ.get("KPT_SDPA_BACKENDS", "").split(",") if b}


def sdpa_backends(call):
    """`call` (an SDPA call) under each SDPA backend that takes it: flash, cuDNN, efficient
    (those of `KPT_SDPA_BACKENDS` where it is set)."""
    out = []
    for name in ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION"):
        if SDPA_ONLY and name.split("_")[0].lower() not in SDPA_ONLY:
            continue
        backend = getattr(SDPBackend, name)

        def f(backend=backend):
            with sdpa_kernel(backend):
                return call()

        try:
            f()
        except RuntimeError:
            continue  # this backend does not take the case
        out.append((f"SDPA {name.split('_')[0].lower()}", f))
    return out


def sliding_window_variants(q, k, v, w):
    """Causal attention where query i sees keys i - w < j <= i, as torch users run it: SDPA
    with a boolean mask (each backend that takes one), and FlexAttention (compiled) with a
    block mask that skips the tiles outside the window."""
    s = q.shape[2]
    i = torch.arange(s, device=q.device)
    mask = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - w)
    out = sdpa_backends(
        lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    )
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        def window(b, h, qi, kj):
            return (kj <= qi) & (qi - kj < w)

        block_mask = create_block_mask(window, B=None, H=None, Q_LEN=s, KV_LEN=s)
        flex = torch.compile(flex_attention)

        def run():
            return flex(q, k, v, block_mask=block_mask, enable_gqa=True)

        run()
        out.append(("FlexAttention (compiled)", run))
    except Exception as e:  # no Triton or no FlexAttention in this torch
        print(f"FlexAttention skipped: {e}", file=sys.stderr)
    return out


def varlen_variants(lens, h, d, causal, dt):
    """Sequences of lengths `lens` packed into `[total, h, d]`, as torch users run them: SDPA
    on nested (jagged) tensors under each backend that takes them, and FlexAttention
    (compiled) with a document mask over the packed rows (block mask built once, not
    timed)."""
    total = sum(lens)
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    offsets = torch.tensor(cu, device="cuda", dtype=torch.int64)
    q, k, v = (rand((total, h, d), dt, -2.0, 2.0) for _ in range(3))
    out = []
    try:
        nq, nk, nv = (
            torch.nested.nested_tensor_from_jagged(x, offsets).transpose(1, 2) for x in (q, k, v)
        )
        nested = sdpa_backends(
            lambda: F.scaled_dot_product_attention(nq, nk, nv, is_causal=causal)
        )
        out += [(f"{name} (nested)", f) for name, f in nested]
    except Exception as e:  # no nested-tensor SDPA in this torch
        print(f"nested SDPA skipped: {e}", file=sys.stderr)
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        doc = torch.repeat_interleave(
            torch.arange(len(lens), device="cuda"), torch.tensor(lens, device="cuda")
        )

        def document(b, hh, qi, kj):
            same = doc[qi] == doc[kj]
            return same & (kj <= qi) if causal else same

        block_mask = create_block_mask(document, B=None, H=None, Q_LEN=total, KV_LEN=total)
        flex = torch.compile(flex_attention)
        qf, kf, vf = (x.transpose(0, 1).unsqueeze(0).contiguous() for x in (q, k, v))

        def run():
            return flex(qf, kf, vf, block_mask=block_mask)

        run()
        out.append(("FlexAttention (compiled)", run))
    except Exception as e:  # no Triton or no FlexAttention in this torch
        print(f"FlexAttention skipped: {e}", file=sys.stderr)
    return out


def backward_of(forward, inputs, dout):
    """The backward of one run of `forward` (run once here, not timed), as
    `out.backward(dout)` would run it, without accumulating .grad."""
    o = forward()
    return lambda: torch.autograd.grad(o, inputs, dout, retain_graph=True)


def variants(req):
    """The PyTorch implementations of one case: a list of (name, callable)."""
    kind = req["kind"]
    dt = DTYPES[req.get("dtype", "bf16")]
    if kind == "gemm":
        m, k, n = req["m"], req["k"], req["n"]
        a, b = rand((m, k), dt), rand((k, n), dt)
        out = torch.empty((m, n), dtype=dt, device="cuda")
        return [("torch.matmul", lambda: torch.matmul(a, b, out=out))]
    if kind == "linear":
        m, k, n = req["m"], req["k"], req["n"]
        x, w = rand((m, k), dt), rand((n, k), dt, -0.05, 0.05)
        f = lambda: F.linear(x, w)
        if not req.get("compile", True):
            return [("torch eager", f)]
        return [("torch eager", f), ("torch.compile", compiled(f))]
    if kind == "linear_gelu":
        m, k, n = req["m"], req["k"], req["n"]
        x, w, bias = rand((m, k), dt), rand((n, k), dt, -0.02, 0.02), rand((n,), dt)
        f = lambda: F.gelu(F.linear(x, w, bias), approximate="tanh")
        g = compiled(f)
        return [("torch.compile", g), ("torch eager", f)]
    if kind == "fp8_gemm":
        m, k, n = req["m"], req["k"], req["n"]
        a = rand((m, k), torch.float32).to(torch.float8_e4m3fn)
        b = rand((n, k), torch.float32).to(torch.float8_e4m3fn)
        one = torch.ones((), device="cuda")
        return [
            (
                "torch._scaled_mm",
                lambda: torch._scaled_mm(a, b.t(), one, one, out_dtype=torch.bfloat16),
            )
        ]
    if kind in ("rms_norm", "add_rms_norm"):
        rows, dim = req["rows"], req["dim"]
        x, r, w = rand((rows, dim), dt), rand((rows, dim), dt), rand((dim,), dt, 0.5, 1.5)
        if kind == "rms_norm":
            f = lambda: F.rms_norm(x, (dim,), w, 1e-5)
            return [("torch.compile", compiled(f)), ("F.rms_norm", f)]

        def add_norm():
            s = x + r
            return s, F.rms_norm(s, (dim,), w, 1e-5)

        return [("torch.compile", compiled(add_norm)), ("torch eager", add_norm)]
    if kind == "softmax":
        x = rand((req["rows"], req["dim"]), dt, -4.0, 4.0)
        f = lambda: torch.softmax(x, dim=-1)
        return [("torch.softmax", f), ("torch.compile", compiled(f))]
    if kind == "rotary":
        b, s, h, d = req["batch"], req["seq"], req["heads"], req["head_dim"]
        x = rand((b, s, h, d), dt)
        inv = 10000.0 ** (-torch.arange(0, d, 2, device="cuda", dtype=torch.float32) / d)
        ang = torch.arange(s, device="cuda", dtype=torch.float32)[:, None] * inv[None, :]
        cos = torch.cat((ang.cos(), ang.cos()), -1).to(dt)[None, :, None, :]
        sin = torch.cat((ang.sin(), ang.sin()), -1).to(dt)[None, :, None, :]
        f = lambda: x * cos + rotate_half(x) * sin
        return [("torch.compile", compiled(f)), ("torch eager", f)]
    if kind == "split_rotary":
        t, h, hkv, d = req["tokens"], req["heads"], req["kv_heads"], req["head_dim"]
        qkv = rand((t, (h + 2 * hkv) * d), dt)
        inv = 10000.0 ** (-torch.arange(0, d, 2, device="cuda", dtype=torch.float32) / d)
        ang = torch.arange(t, device="cuda", dtype=torch.float32)[:, None] * inv[None, :]
        cos = torch.cat((ang.cos(), ang.cos()), -1).to(dt)[:, None, :]
        sin = torch.cat((ang.sin(), ang.sin()), -1).to(dt)[:, None, :]

        def split_rotary():
            q, k, v = qkv.split([h * d, hkv * d, hkv * d], dim=-1)
            q, k = q.view(t, h, d), k.view(t, hkv, d)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            return q, k, v.contiguous()

        return [("torch.compile", compiled(split_rotary)), ("torch eager", split_rotary)]
    if kind == "swiglu":
        rows, d = req["rows"], req["d"]
        x = rand((rows, 2 * d), dt, -3.0, 3.0)
        f = lambda: F.silu(x[:, :d]) * x[:, d:]
        return [("torch.compile", compiled(f)), ("torch eager", f)]
    if kind == "quantize":
        x = rand((req["n"],), dt, -10.0, 10.0)
        scale = torch.tensor(10.0 / 448.0, device="cuda")
        f = lambda: (x.float() / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
        return [("torch.compile", compiled(f)), ("torch eager", f)]
    if kind == "attention_prefill":
        b, h, d, s, causal = req["batch"], req["heads"], req["head_dim"], req["seq"], req["causal"]
        hkv = req.get("kv_heads", h)
        dropout = req.get("dropout", 0.0)
        q = rand((b, h, s, d), dt, -2.0, 2.0)
        k, v = rand((b, hkv, s, d), dt, -2.0, 2.0), rand((b, hkv, s, d), dt, -2.0, 2.0)
        if "window" in req:
            return sliding_window_variants(q, k, v, req["window"])
        if hkv == h:
            return sdpa_backends(
                lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, dropout_p=dropout)
            )
        out = sdpa_backends(
            lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
        )
        # Grouped-query attention as HF's LLaMA runs it: K/V repeated to every query head
        # (done once here, not timed), then any backend.
        ke, ve = k.repeat_interleave(h // hkv, 1), v.repeat_interleave(h // hkv, 1)
        expanded = sdpa_backends(
            lambda: F.scaled_dot_product_attention(q, ke, ve, is_causal=causal)
        )
        return out + [(f"{name} (expanded K/V)", f) for name, f in expanded]
    if kind == "attention_varlen":
        return varlen_variants(req["lens"], req["heads"], req["head_dim"], req["causal"], dt)
    if kind == "attention_backward":
        b, h, d, s, causal = req["batch"], req["heads"], req["head_dim"], req["seq"], req["causal"]
        dropout = req.get("dropout", 0.0)
        q, k, v = (rand((b, h, s, d), dt, -2.0, 2.0).requires_grad_() for _ in range(3))
        dout = rand((b, h, s, d), dt, -2.0, 2.0)
        if "window" in req:
            return [
                (name, backward_of(forward, (q, k, v), dout))
                for name, forward in sliding_window_variants(q, k, v, req["window"])
            ]
        out = []
        # The forward runs once under each backend; its backward (the same backend's) is
        # what is timed, as `out.backward(dout)` would run it, without accumulating .grad.
        # It gets what that forward saved (the flash backend: the output and the softmax
        # log-sum-exp); kpt's backward rows are handed its forward's output and log-sum-exp
        # likewise (benches/gpu/main.rs).
        for name, forward in sdpa_backends(
            lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, dropout_p=dropout)
        ):
            o = forward()

            def backward(o=o):
                return torch.autograd.grad(o, (q, k, v), dout, retain_graph=True)

            try:
                backward()
            except RuntimeError:
                continue  # this backend has no backward for the case
            out.append((name, backward))
        return out
    if kind == "attention_decode":
        b, hq, hkv, d, s = req["batch"], req["heads"], req["kv_heads"], req["head_dim"], req["seq_kv"]
        q = rand((b, hq, req.get("seq_q", 1), d), dt, -2.0, 2.0)
        k, v = rand((b, hkv, s, d), dt, -2.0, 2.0), rand((b, hkv, s, d), dt, -2.0, 2.0)
        out = sdpa_backends(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
        # What a user without GQA support in a backend runs: K/V expanded to every head.
        ke, ve = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
        out.append(("SDPA (expanded K/V)", lambda: F.scaled_dot_product_attention(q, ke, ve)))
        return out
    if kind == "copy":
        x = rand((req["n"],), dt)
        y = torch.empty_like(x)
        return [("Tensor.copy_", lambda: y.copy_(x))]
    raise ValueError(f"unknown case kind {kind}")


def time_calls(fn, inner, reps):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    out = []
    for _ in range(reps):
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) / 1e3 / inner)
    return out


def driver():
    try:
        return subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, check=True,
        ).stdout.strip().splitlines()[0]
    except (OSError, subprocess.CalledProcessError, IndexError):
        return "unknown"


def main():
    import triton

    info = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton.__version__,
        "device": torch.cuda.get_device_name(0),
        "driver": driver(),
    }
    print(json.dumps(info), flush=True)
    # The last case's variants (inputs, compiled functions), kept while requests for
    # the same case come in: the caller interleaves single repetitions with its own.
    cached_key, cached = None, None
    for line in sys.stdin:
        req = json.loads(line)
        key = json.dumps({k: v for k, v in req.items() if k not in ("inner", "reps")},
                         sort_keys=True)
        try:
            if key != cached_key:
                cached_key, cached = None, None
                torch.cuda.empty_cache()
                cached_key, cached = key, variants(req)
            result = {
                name: time_calls(fn, req["inner"], req["reps"])
                for name, fn in cached
            }
            print(json.dumps({"variants": result}), flush=True)
        except Exception as e:  # reported to the caller as the row's note
            cached_key, cached = None, None
            print(json.dumps({"error": f"{type(e).__name__}: {e}"}), flush=True)


if __name__ == "__main__":
    main()
