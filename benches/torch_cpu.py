"""PyTorch side of kpt's CPU side-by-side benchmark (`cargo xtask bench-cpu`).

Protocol: one JSON object per line on stdin, one JSON reply per line on stdout.
The first reply (before any request) describes the environment. Each request names a
case and a timing budget; the reply holds the per-call times of every variant that was
timed, so that the caller can take the same statistics on both sides.

Timing is the same as on the kpt side: each call is timed with a monotonic clock around
the call alone (inputs and preallocated outputs already exist), after warm-up calls.
"""

import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}


def rand(shape, dtype, gen, lo=-1.0, hi=1.0):
    return (torch.rand(shape, generator=gen) * (hi - lo) + lo).to(dtype)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def variants(req, gen):
    """The PyTorch implementations of one case: a list of (name, callable)."""
    kind = req["kind"]
    dt = DTYPES[req.get("dtype", "f32")]
    if kind == "gemm":
        m, k, n = req["m"], req["k"], req["n"]
        a, b = rand((m, k), dt, gen), rand((k, n), dt, gen)
        out = torch.empty((m, n), dtype=dt)
        return [("torch.matmul", lambda: torch.matmul(a, b, out=out))]
    if kind == "linear_gelu":
        m, k, n = req["m"], req["k"], req["n"]
        bound = 1.0 / math.sqrt(k)
        x = rand((m, k), dt, gen)
        w = rand((n, k), dt, gen, -bound, bound)
        bias = rand((n,), dt, gen, -bound, bound)
        return [
            (
                "torch eager F.gelu(F.linear)",
                lambda: F.gelu(F.linear(x, w, bias), approximate="tanh"),
            )
        ]
    if kind == "attention":
        b, h, s, d = req["batch"], req["heads"], req["seq"], req["head_dim"]
        causal = req["causal"]
        q, k, v = (rand((b, h, s, d), dt, gen) for _ in range(3))
        return [
            (
                "F.scaled_dot_product_attention",
                lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
            )
        ]
    if kind == "rms_norm":
        rows, dim, eps = req["rows"], req["dim"], req["eps"]
        x = rand((rows, dim), dt, gen, -3.0, 3.0)
        w = rand((dim,), dt, gen, 0.5, 1.5)

        def composed():
            # The LLaMA / HF transformers formulation.
            return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

        return [
            ("F.rms_norm", lambda: F.rms_norm(x, (dim,), w, eps)),
            ("torch eager (HF LlamaRMSNorm)", composed),
        ]
    if kind == "layer_norm":
        rows, dim, eps = req["rows"], req["dim"], req["eps"]
        x = rand((rows, dim), dt, gen, -3.0, 3.0)
        w = rand((dim,), dt, gen, 0.5, 1.5)
        bias = rand((dim,), dt, gen, -0.5, 0.5)
        return [("F.layer_norm", lambda: F.layer_norm(x, (dim,), w, bias, eps))]
    if kind == "softmax":
        rows, dim = req["rows"], req["dim"]
        x = rand((rows, dim), dt, gen, -5.0, 5.0)
        return [("torch.softmax", lambda: torch.softmax(x, dim=-1))]
    if kind == "rotary":
        b, h, s, d, theta = req["batch"], req["heads"], req["seq"], req["head_dim"], req["theta"]
        x = rand((b, h, s, d), dt, gen)
        inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        ang = torch.outer(torch.arange(s, dtype=torch.float64), inv)
        emb = torch.cat((ang, ang), dim=-1)
        cos, sin = emb.cos().to(dt), emb.sin().to(dt)
        # The HF transformers formulation, with the cos/sin cache precomputed.
        return [("torch eager (HF apply_rotary_pos_emb)", lambda: x * cos + rotate_half(x) * sin)]
    raise ValueError(f"unknown case kind {kind!r}")


def time_calls(fn, warmup, min_reps, max_reps, budget_s, slow_call_budgets):
    for i in range(warmup):
        t0 = time.perf_counter()
        fn()
        t = time.perf_counter() - t0
        if i == 0 and t > slow_call_budgets * budget_s:
            return [t]  # the slow first call is the measurement (same rule as kpt's)
    times = []
    start = time.perf_counter()
    while len(times) < max_reps and (
        len(times) < min_reps or time.perf_counter() - start < budget_s
    ):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def main():
    threads = int(os.environ.get("KPT_BENCH_THREADS", "0")) or os.cpu_count()
    torch.set_num_threads(threads)
    info = {
        "torch": torch.__version__.split("+")[0],
        "torch_full": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "mkldnn": torch.backends.mkldnn.is_available(),
    }
    print(json.dumps(info), flush=True)
    gen = torch.Generator().manual_seed(0)
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        req = json.loads(line)
        try:
            reply = {"variants": {}}
            with torch.inference_mode():
                for name, fn in variants(req, gen):
                    reply["variants"][name] = time_calls(
                        fn,
                        req["warmup"],
                        req["min_reps"],
                        req["max_reps"],
                        req["budget_s"],
                        req["slow_call_budgets"],
                    )
        except Exception as e:  # reported per case, the run goes on
            reply = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
