"""Runs torch's SDPA on the cuDNN backend a few times on random bf16 inputs, so that a
profiler can take one of its launches: `sdpa_cudnn.py B H S D full|causal`."""

import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def main() -> None:
    b, h, s, d = map(int, sys.argv[1:5])
    causal = sys.argv[5] == "causal"
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        for _ in range(6):
            F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
