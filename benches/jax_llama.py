"""The same LLaMA-shaped model as kpt, written in JAX and jitted: the baseline of
`kpt-bench-xla` (the prefill of a Hugging Face checkpoint on one device).

Usage: python jax_llama.py --dir CHECKPOINT --seq S --dtype f32|bf16 --reps N --logits OUT
Prints one JSON line: {"median_ms": ..., "jax": version, "device": ...}; writes the last
position's logits (f32) to OUT. The prompt is ids[i] = (7 i + 3) % vocab, positions
0..S-1, the same as kpt's side.
"""

import argparse
import glob
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import load_file


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--seq", type=int, required=True)
    ap.add_argument("--dtype", choices=["f32", "bf16"], default="f32")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--logits", required=True)
    a = ap.parse_args()
    # f32 products at full precision on every device, as kpt asks XLA for.
    jax.config.update("jax_default_matmul_precision", "highest")

    cfg = json.load(open(os.path.join(a.dir, "config.json")))
    dt = jnp.float32 if a.dtype == "f32" else jnp.bfloat16
    weights = {}
    for f in sorted(glob.glob(os.path.join(a.dir, "*.safetensors"))):
        weights.update(load_file(f))
    p = {k: jnp.asarray(v, dtype=dt) for k, v in weights.items()}
    hidden = cfg["hidden_size"]
    heads = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads", heads)
    hd = cfg.get("head_dim", hidden // heads)
    layers = cfg["num_hidden_layers"]
    eps = cfg.get("rms_norm_eps", 1e-6)
    rope = cfg.get("rope_parameters") or {}
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    vocab = cfg["vocab_size"]
    head_name = "lm_head.weight" if "lm_head.weight" in p else "model.embed_tokens.weight"

    def rms(x, w):
        x32 = x.astype(jnp.float32)
        r = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
        return (x32 * r).astype(dt) * w

    inv_freq = theta ** (-np.arange(0, hd, 2, dtype=np.float64) / hd)
    ang = np.arange(a.seq, dtype=np.float64)[:, None] * inv_freq[None, :]
    cos = jnp.asarray(np.cos(ang), dtype=jnp.float32)[:, None, :]
    sin = jnp.asarray(np.sin(ang), dtype=jnp.float32)[:, None, :]

    def rotary(x):  # [S, H, D], rotate half
        x32 = x.astype(jnp.float32)
        x0, x1 = x32[..., : hd // 2], x32[..., hd // 2 :]
        return jnp.concatenate([x0 * cos - x1 * sin, x1 * cos + x0 * sin], -1).astype(dt)

    # The weights are arguments of the jitted function, as a JAX program holds its
    # parameters (closed over, they would be constants that XLA folds transposes into).
    def forward(p, ids):
        x = p["model.embed_tokens.weight"][ids]
        s = ids.shape[0]
        for i in range(layers):
            pre = f"model.layers.{i}."
            h = rms(x, p[pre + "input_layernorm.weight"])
            q = (h @ p[pre + "self_attn.q_proj.weight"].T).reshape(s, heads, hd)
            k = (h @ p[pre + "self_attn.k_proj.weight"].T).reshape(s, kv, hd)
            v = (h @ p[pre + "self_attn.v_proj.weight"].T).reshape(s, kv, hd)
            q, k = rotary(q), rotary(k)
            o = jax.nn.dot_product_attention(q[None], k[None], v[None], is_causal=True)[0]
            x = x + o.reshape(s, heads * hd) @ p[pre + "self_attn.o_proj.weight"].T
            h = rms(x, p[pre + "post_attention_layernorm.weight"])
            g = jax.nn.silu(h @ p[pre + "mlp.gate_proj.weight"].T)
            u = h @ p[pre + "mlp.up_proj.weight"].T
            x = x + (g * u) @ p[pre + "mlp.down_proj.weight"].T
        x = rms(x, p["model.norm.weight"])
        return (x @ p[head_name].T).astype(jnp.float32)

    f = jax.jit(forward)
    ids = jnp.asarray((np.arange(a.seq) * 7 + 3) % vocab, dtype=jnp.int32)
    out = f(p, ids).block_until_ready()
    times = []
    for _ in range(a.reps):
        t = time.perf_counter()
        f(p, ids).block_until_ready()
        times.append((time.perf_counter() - t) * 1e3)
    np.asarray(out[-1], dtype=np.float32).tofile(a.logits)
    print(json.dumps({
        "median_ms": statistics.median(times),
        "jax": jax.__version__,
        "device": str(jax.devices()[0]),
    }))


if __name__ == "__main__":
    main()
