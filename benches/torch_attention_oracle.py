"""kpt's attention variants computed by PyTorch's scaled_dot_product_attention, as an
oracle for kpt-nvidia's `torch_oracle` test (tests/torch_oracle.rs).

Usage: python3 torch_attention_oracle.py DIR DEVICE

DIR/cases.json lists the cases; each tensor is a file of little-endian f32 values in DIR
(values already rounded to the case's dtype). For each case the script writes its
outputs as DIR/<case>.<output>.f32: `out` for a forward case, `dq`, `dk` and `dv` for a
backward one. Layouts are kpt's: q and out [B, S, Hq*D], k and v [B, T, Hkv*D]; causal
masking is bottom-right aligned (query i sees key j iff j <= i + T - S), a sliding
window of w keys keeps j > i + T - S - w, and a row that sees no key gives zeros.
Packed (variable-length) batches run sequence by sequence. FP8 cases hold the
dequantized values and run in bf16 (torch has no FP8 attention).
"""

import json
import os
import sys

import torch
import torch.nn.functional as F

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16, "fp8": torch.bfloat16}


def load(path, shape, dtype, device):
    with open(path, "rb") as f:
        t = torch.frombuffer(bytearray(f.read()), dtype=torch.float32).reshape(shape)
    return t.to(device=device, dtype=dtype)


def save(path, t):
    raw = t.detach().to(torch.float32).cpu().contiguous().reshape(-1).view(torch.uint8)
    with open(path, "wb") as f:
        f.write(bytes(raw.tolist()))


def bias(case, s, t, mask, device):
    """Additive [s, t] f32 bias: the case's mask plus -inf where causality or the
    window hides a key."""
    i = torch.arange(s, device=device)[:, None]
    j = torch.arange(t, device=device)[None, :]
    allowed = torch.ones((s, t), dtype=torch.bool, device=device)
    if case["causal"]:
        allowed &= j <= i + t - s
    if case.get("window") is not None:
        allowed &= j > i + t - s - case["window"]
    b = torch.zeros((s, t), dtype=torch.float32, device=device)
    if mask is not None:
        b = b + mask
    return b.masked_fill(~allowed, float("-inf"))


def attention(case, q, k, v, mask, device):
    """One dense batch in kpt's layout -> out [B, S, Hq*D] (and the heads' view)."""
    bsz, s, _ = q.shape
    t = k.shape[1]
    h, hkv, d = case["heads"], case["kv_heads"], case["head_dim"]
    qh = q.view(bsz, s, h, d).transpose(1, 2)
    kh = k.view(bsz, t, hkv, d).transpose(1, 2).repeat_interleave(h // hkv, 1)
    vh = v.view(bsz, t, hkv, d).transpose(1, 2).repeat_interleave(h // hkv, 1)
    b = bias(case, s, t, mask, device).to(q.dtype)
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=b, scale=case["scale"])
    # Rows that see no key: torch gives NaN, kpt zeros.
    out = torch.nan_to_num(out, nan=0.0)
    return out.transpose(1, 2).reshape(bsz, s, h * d)


def run(case, folder, device):
    dt = DTYPES[case["dtype"]]
    shapes = case["shapes"]
    x = {n: load(os.path.join(folder, f"{case['name']}.{n}.f32"), shapes[n], dt, device)
         for n in case["tensors"]}
    mask = x.get("mask")
    if mask is not None:
        mask = mask.float()
    if case["kind"] == "backward":
        q, k, v = (x[n].clone().requires_grad_() for n in ("q", "k", "v"))
        out = attention(case, q, k, v, mask, device)
        out.backward(x["dout"])
        for n, g in (("dq", q.grad), ("dk", k.grad), ("dv", v.grad)):
            save(os.path.join(folder, f"{case['name']}.{n}.f32"), g)
        return
    q, k, v = x["q"], x["k"], x["v"]
    with torch.no_grad():
        if case.get("cu_seqlens") is not None:
            cu_q, cu_k = case["cu_seqlens"]
            out = torch.zeros_like(q)
            for n in range(len(cu_q) - 1):
                qs, ks = slice(cu_q[n], cu_q[n + 1]), slice(cu_k[n], cu_k[n + 1])
                if qs.start == qs.stop or ks.start == ks.stop:
                    continue
                out[:, qs] = attention(case, q[:, qs], k[:, ks], v[:, ks], None, device)
        else:
            out = attention(case, q, k, v, mask, device)
    save(os.path.join(folder, f"{case['name']}.out.f32"), out)


def main():
    folder, device = sys.argv[1], sys.argv[2]
    with open(os.path.join(folder, "cases.json")) as f:
        cases = json.load(f)
    for case in cases:
        run(case, folder, device)
    print(json.dumps({"torch": torch.__version__, "device": device, "cases": len(cases)}))


if __name__ == "__main__":
    main()
