"""Hugging Face transformers side of kpt's model benchmark (`kpt-bench-models`).

Protocol: one JSON object per line on stdin, one JSON reply per line on stdout; the
first reply (before any request) describes the environment. Requests (`op`):

- `create`: builds a LLaMA-shaped `LlamaForCausalLM` from `config` with random weights
  (seeded), in `dtype`, and saves it as safetensors to `dir` (the checkpoint kpt loads).
- `prefill`: times `model(ids)` on random ids `[batch, seq]`; `reps` calls after warm-up,
  each between CUDA events (wall clock on the CPU). `logits_to_keep: 1` computes the
  last position's logits only, as `generate` does for its first token.
- `decode`: prefills `context` random tokens per sequence (not timed), then times `steps`
  greedy decode steps with the KV cache; seconds per step, one value per repetition.
- `logits`: the logits of `ids` (one sequence) at the last `last` positions, in `dtype`
  (fp32: IEEE products and SDPA's math backend).
- `greedy`: `new` greedy tokens after `ids` (with `with_logits`, each step's logits too).
- `load`: loads the checkpoint in `dir` (any architecture transformers knows: a causal LM,
  or with `encoder` the base model) in fp32 on `device` (default: CUDA when present), in
  place of the created model, for `logits`, `greedy` and `encode`.
- `encode`: an encoder's last hidden states of `seqs` (a padded batch with its attention
  mask and token type 0) and their mean over each sequence's tokens, in `dtype`.

Attention runs through `attn_implementation="sdpa"`, as the issue's baseline names.
"""

import contextlib
import copy
import json
import os
import sys
import time

import torch
import transformers
from transformers import AutoModel, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}


class Timer:
    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def __call__(self, fn):
        if self.cuda:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0


@contextlib.contextmanager
def ieee_fp32():
    """IEEE fp32 products (no TF32) in cuBLAS and cuDNN, through the old and the new
    (torch >= 2.9 `fp32_precision`) switches, restored afterwards."""
    saved = []

    def set_attr(obj, name, value):
        if hasattr(obj, name):
            saved.append((obj, name, getattr(obj, name)))
            setattr(obj, name, value)

    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    set_attr(torch.backends.cuda.matmul, "allow_tf32", False)
    set_attr(torch.backends.cudnn, "allow_tf32", False)
    set_attr(torch.backends.cuda.matmul, "fp32_precision", "ieee")
    set_attr(torch.backends.cudnn, "fp32_precision", "ieee")
    try:
        yield
    finally:
        for obj, name, value in reversed(saved):
            setattr(obj, name, value)
        torch.set_float32_matmul_precision(precision)


@contextlib.contextmanager
def exact(dtype):
    """For fp32 (`dtype` "f32"), `ieee_fp32` and SDPA's math backend, so that a run is as
    exact as its dtype allows; other dtypes run as they are."""
    if dtype != "f32":
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with ieee_fp32(), sdpa_kernel(SDPBackend.MATH):
        yield


def fp32_rotary(model):
    """`.to(dtype)` also rounds the rotary embedding's inverse frequencies (a buffer) to
    that dtype, which `from_pretrained(torch_dtype=...)` does not do: put them back in
    fp32, as a loaded checkpoint has them."""
    for module in model.modules():
        if isinstance(getattr(module, "inv_freq", None), torch.Tensor):
            device = module.inv_freq.device
            fresh = type(module)(config=model.config)
            module.inv_freq = fresh.inv_freq.float().to(device)
            if hasattr(module, "original_inv_freq"):
                module.original_inv_freq = fresh.original_inv_freq.float().to(device)
    return model


class Worker:
    def __init__(self):
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.timer = Timer(self.device)
        self.models = {}  # dtype name -> model
        self.config = None

    def model(self, dtype):
        """The created model in `dtype` (a converted copy, made once)."""
        if dtype not in self.models:
            base = next(iter(self.models.values()))
            self.models[dtype] = fp32_rotary(copy.deepcopy(base).to(DTYPES[dtype]))
        return self.models[dtype]

    def create(self, req):
        self.config = LlamaConfig(**req["config"], attn_implementation="sdpa")
        torch.manual_seed(req.get("seed", 0))
        with torch.device(self.device):
            model = LlamaForCausalLM(self.config)
        model = fp32_rotary(model.to(DTYPES[req["dtype"]]).eval())
        model.save_pretrained(req["dir"])  # safetensors, the default
        self.models = {req["dtype"]: model}
        return {"params": sum(p.numel() for p in model.parameters())}

    def ids(self, batch, seq):
        return torch.randint(0, self.config.vocab_size, (batch, seq), device=self.device)

    @torch.inference_mode()
    def prefill(self, req):
        model = self.model(req["dtype"])
        ids = self.ids(req["batch"], req["seq"])
        keep = req.get("logits_to_keep", 0)

        def run():
            return model(ids, logits_to_keep=keep)

        for _ in range(2):
            run()
        return {"seconds": [self.timer(run) for _ in range(req["reps"])]}

    @torch.inference_mode()
    def decode(self, req):
        model = self.model(req["dtype"])
        ids = self.ids(req["batch"], req["context"])
        steps = req["steps"]

        def run():
            out = model(ids, use_cache=True)
            cache = out.past_key_values
            nxt = out.logits[:, -1:].argmax(-1)
            state = {"cache": cache, "next": nxt}

            def decode_steps():
                for _ in range(steps):
                    o = model(state["next"], past_key_values=state["cache"], use_cache=True)
                    state["cache"] = o.past_key_values
                    state["next"] = o.logits[:, -1:].argmax(-1)

            return self.timer(decode_steps) / steps

        run()  # warm-up
        return {"seconds": [run() for _ in range(req["reps"])]}

    @torch.inference_mode()
    def logits(self, req):
        """Logits for an accuracy comparison. fp32: IEEE products (no TF32) and SDPA's
        math backend, so that the run is as exact as its dtype allows; other dtypes run
        as `greedy` does (SDPA's default choice)."""
        model = self.model(req["dtype"])
        ids = torch.tensor([req["ids"]], device=self.device)
        with exact(req["dtype"]):
            out = model(ids).logits
        return {"logits": out[0, -req["last"]:].float().cpu().tolist()}

    @torch.inference_mode()
    def greedy(self, req):
        model = self.model(req["dtype"])
        ids = torch.tensor([req["ids"]], device=self.device)
        exact = ieee_fp32() if req["dtype"] == "f32" else contextlib.nullcontext()
        with exact:
            out = model(ids, use_cache=True)
            cache, tokens, rows = out.past_key_values, [], []
            last = out.logits[:, -1:]
            for _ in range(req["new"]):
                nxt = last.argmax(-1)
                tokens.append(int(nxt[0, 0]))
                rows.append(last[0, 0].float().cpu().tolist())
                o = model(nxt, past_key_values=cache, use_cache=True)
                cache, last = o.past_key_values, o.logits[:, -1:]
        reply = {"tokens": tokens}
        if req.get("with_logits"):
            reply["logits"] = rows
        return reply

    def load(self, req):
        if "device" in req:
            self.device = torch.device(req["device"])
            self.timer = Timer(self.device)
        auto = AutoModel if req.get("encoder") else AutoModelForCausalLM
        model = auto.from_pretrained(
            req["dir"], torch_dtype=torch.float32, attn_implementation="sdpa"
        )
        model = fp32_rotary(model.to(self.device).eval())
        self.config = model.config
        self.models = {"f32": model}
        return {"class": type(model).__name__}

    @torch.inference_mode()
    def encode(self, req):
        """Last hidden states and mean pooling of a padded batch; fp32 as `logits`."""
        model = self.model(req["dtype"])
        seqs = req["seqs"]
        width = max(len(s) for s in seqs)
        ids = torch.zeros((len(seqs), width), dtype=torch.long, device=self.device)
        mask = torch.zeros_like(ids)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s, device=self.device)
            mask[i, : len(s)] = 1
        with exact(req["dtype"]):
            hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state.float()
        m = mask.unsqueeze(-1).float()
        pooled = (hidden * m).sum(1) / m.sum(1)
        return {
            "hidden": [hidden[i, : len(s)].cpu().tolist() for i, s in enumerate(seqs)],
            "pooled": pooled.cpu().tolist(),
        }


def main():
    if "KPT_BENCH_THREADS" in os.environ:
        torch.set_num_threads(int(os.environ["KPT_BENCH_THREADS"]))
    worker = Worker()
    info = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "threads": torch.get_num_threads(),
    }
    print(json.dumps(info), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        try:
            reply = getattr(worker, req["op"])(req)
        except Exception as e:  # reported to the caller
            reply = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
