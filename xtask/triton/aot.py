"""Ahead-of-time compilation of kpt's Triton kernels (run by `cargo xtask build-kernels`).

Usage: aot.py SOURCE OUT_DIR [cuda|hip]

Imports SOURCE (a file under kernels/triton/), compiles every specialization its
`kpt_entry_points()` lists for each target below (NVIDIA's by default, AMD's with
`hip`), writes the binaries into OUT_DIR and prints one JSON document describing them on
stdout. Needs no GPU.
"""

import importlib.util
import json
import sys
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend

# (manifest target, format, compute capability): cubins for Ampere and Hopper (Triton
# compiles 90 as sm_90a), PTX for Ampere and newer (taken from the sm_80 compile).
TARGETS = [("sm_80", "cubin", 80), ("sm_90a", "cubin", 90), ("compute_80", "ptx", 80)]

# AMD processors and their wave sizes: CDNA 2 (MI200), CDNA 3 (MI300X) and RDNA 3 (RX 7900).
# A program of `num_warps` waves has wave * num_warps threads, so the launch block
# differs per processor and each gets its own manifest entry.
HIP_TARGETS = [("gfx90a", 64), ("gfx942", 64), ("gfx1100", 32)]


def parse_signature(fn, signature):
    """`["*bf16:16", "i32", ...]` -> (types by name, attrs with divisibility hints)."""
    types, attrs = {}, {}
    for i, (name, sig) in enumerate(zip(fn.arg_names, signature)):
        ty, _, hint = sig.partition(":")
        types[name] = ty
        if hint:
            if hint != "16":
                raise ValueError(f"{fn.__name__}: only the hint :16 is supported, got {sig}")
            attrs[(i,)] = [["tt.divisibility", 16]]
    return types, attrs


def compile_entry(entry, out_dir):
    fn = entry["fn"]
    types, attrs = parse_signature(fn, entry["signature"])
    for name in entry["constexprs"]:
        types[name] = "constexpr"
    missing = [a for a in fn.arg_names if a not in types]
    if missing:
        raise ValueError(f"{entry['kernel']}: no type for {missing}")
    src = ASTSource(fn=fn, signature=types, constexprs=entry["constexprs"], attrs=attrs)
    artifacts, shared, name = [], 0, None
    compiled = {}
    for target, fmt, cc in TARGETS:
        if cc not in compiled:
            gpu = GPUTarget("cuda", cc, 32)
            opts = {"num_warps": entry["num_warps"], "num_stages": entry.get("num_stages", 3)}
            if cc == 80:
                # The sm_80 build also gives the PTX fallback: write it at the ISA that
                # CUDA 12.0 drivers JIT (see PTX_ISA in xtask/src/kernels.rs).
                opts["ptx_version"] = 80
            options = make_backend(gpu).parse_options(opts)
            compiled[cc] = triton.compile(src, target=gpu, options=options.__dict__)
        k = compiled[cc]
        meta = k.metadata
        if getattr(meta, "global_scratch_size", 0) or getattr(meta, "profile_scratch_size", 0):
            raise RuntimeError(f"{entry['kernel']}: kernels needing scratch memory are not supported")
        shared = max(shared, meta.shared)
        name = meta.name
        data = k.asm[fmt]
        file = out_dir / f"{entry['kernel']}.{target}.{fmt}"
        file.write_bytes(data if isinstance(data, bytes) else data.encode())
        artifacts.append({"target": target, "format": fmt, "file": file.name})
    return {
        "kernel": entry["kernel"],
        "entry": name,
        "block": 32 * entry["num_warps"],
        "shared": shared,
        "grid": entry["grid"],
        "artifacts": artifacts,
    }


def compile_entry_hip(entry, out_dir):
    """One record per AMD processor: the HSACO and the launch block for its wave size."""
    fn = entry["fn"]
    types, attrs = parse_signature(fn, entry["signature"])
    for name in entry["constexprs"]:
        types[name] = "constexpr"
    src = ASTSource(fn=fn, signature=types, constexprs=entry["constexprs"], attrs=attrs)
    out = []
    for arch, wave in HIP_TARGETS:
        gpu = GPUTarget("hip", arch, wave)
        opts = {"num_warps": entry["num_warps"], "num_stages": entry.get("num_stages", 2)}
        options = make_backend(gpu).parse_options(opts)
        k = triton.compile(src, target=gpu, options=options.__dict__)
        meta = k.metadata
        if getattr(meta, "global_scratch_size", 0) or getattr(meta, "profile_scratch_size", 0):
            raise RuntimeError(f"{entry['kernel']}: kernels needing scratch memory are not supported")
        file = out_dir / f"{entry['kernel']}.{arch}.hsaco"
        file.write_bytes(k.asm["hsaco"])
        out.append({
            "kernel": entry["kernel"],
            "entry": meta.name,
            "block": wave * entry["num_warps"],
            "shared": meta.shared,
            "grid": entry["grid"],
            "artifacts": [{"target": arch, "format": "hsaco", "file": file.name}],
        })
    return out


def main():
    source, out_dir = Path(sys.argv[1]), Path(sys.argv[2])
    mode = sys.argv[3] if len(sys.argv) > 3 else "cuda"
    out_dir.mkdir(parents=True, exist_ok=True)
    spec = importlib.util.spec_from_file_location(source.stem, source)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if mode == "hip":
        kernels = [k for e in module.kpt_entry_points() for k in compile_entry_hip(e, out_dir)]
    elif mode == "cuda":
        kernels = [compile_entry(e, out_dir) for e in module.kpt_entry_points()]
    else:
        raise ValueError(f"unknown mode {mode!r} (cuda or hip)")
    json.dump({"triton": triton.__version__, "kernels": kernels}, sys.stdout)


if __name__ == "__main__":
    main()
