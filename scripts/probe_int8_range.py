"""What int8 could give on a CPU whose int8 products saturate (no VNNI or AMX), and why `--precision int8` is refused
there.

Without VNNI or AMX, oneDNN multiplies u8 by s8 with ``vpmaddubsw``, which adds each pair of products in int16 with
saturation: 255 x 127 twice is clipped at 32,767. A product that cannot saturate needs one side narrowed by a bit
(7-bit activations, as torch's own x86 quantisation does with ``reduce_range``, or 7-bit weights), or an exact but
slow kernel (``torch._int_mm``). This measures each on all-MiniLM-L6-v2:

- quality: min and mean cosine of mean-pooled vectors against fp32 on STS-B test sentences and SciFact passages,
  with the library's own int8 scheme (``retrieval.encode.int8.quantise``: SmoothQuant factors, per-tensor
  activations but per-token in the down projection, per-channel weights) and the products emulated exactly in
  float64 at 8/8, 7/8 and 8/7 bits (activations / weights), and with more or fewer layers quantising their input
  per tensor: what a kernel that does not saturate would compute (at 8/8, what VNNI and AMX compute);
- speed: one feed-forward-sized product (4,096 tokens x 384 -> 1,536) in fp32, by oneDNN's u8 x s8 kernel (7-bit
  inputs, so its sums are exact) and by ``torch._int_mm``, median of 5, under the benchmark lock.

    python scripts/probe_int8_range.py                 # -> results/encode/int8-range.{json,md}
    python scripts/probe_int8_range.py --sentences 200 --passages 40
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402

DATA = benchlib.REPO.parent / "shared" / "data"
# bits of activations, of weights; and which layers quantise their input per tensor (the others per token):
# "scheme" as the library does (int8.SCHEME: a self-attention's query, key and value), "none", or the scheme plus
# the layers whose names end so
VARIANTS = {
    "a8w8": (8, 8, "scheme"),
    "a8w8, per token everywhere": (8, 8, "none"),
    "a8w8, + attention output per tensor": (8, 8, "attention.output.dense"),
    "a8w8, + up projection per tensor": (8, 8, "intermediate.dense"),
    "a8w8, per tensor but the down projection": (8, 8, "attention.output.dense,intermediate.dense"),
    "a7w8": (7, 8, "scheme"),
    "a8w7": (8, 7, "scheme"),
}


def emulated_layer(torch: Any, activation_bits: int, weight_bits: int) -> type:
    """A linear layer that rounds as ``Int8Linear`` does at the given widths and multiplies the integers exactly
    (float64), so its output is what a non-saturating int8 kernel would give."""
    weight_top = 2 ** (weight_bits - 1) - 1
    steps = 2**activation_bits - 1
    token_top = 2 ** (activation_bits - 1) - 1

    class Emulated(torch.nn.Module):  # type: ignore[misc, name-defined]
        def __init__(self, linear: Any, smooth: Any, per_token: bool = True, shared: Any = None):
            super().__init__()
            weight = linear.weight.detach().double() * smooth.double()
            self.weight_scale = weight.abs().amax(dim=1).clamp(min=1e-12) / weight_top
            self.weight = torch.round(weight / self.weight_scale[:, None])
            self.inv_smooth = 1 / smooth.double()
            self.bias = linear.bias.detach().double() if linear.bias is not None else torch.zeros(weight.shape[0])
            self.per_token, self.out_features = per_token, linear.out_features

        def forward(self, x: Any) -> Any:
            rows = x.double().reshape(-1, x.shape[-1]) * self.inv_smooth
            if self.per_token:
                scale = (rows.abs().amax(dim=1, keepdim=True) / token_top).clamp(min=1e-12)
                q = torch.round(rows / scale)
                out = (q @ self.weight.T) * scale * self.weight_scale + self.bias
            else:
                high, low = max(float(rows.max()), 0.0), min(float(rows.min()), 0.0)
                scale = max(high - low, 1e-12) / steps
                zero = math.floor(-low / scale)
                q = torch.clamp(torch.floor(rows / scale + zero + 0.5), 0, steps) - zero
                out = (q @ self.weight.T) * scale * self.weight_scale + self.bias
            return out.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    return Emulated


def quality(args: argparse.Namespace) -> list[dict[str, Any]]:
    import torch

    from retrieval.encode import int8
    from retrieval.encode.transformer import TransformerEncoder

    sts = pq.read_table(args.data / "sts" / "stsb-test.parquet").to_pydict()
    sentences = list(dict.fromkeys(sts["sentence1"] + sts["sentence2"]))[: args.sentences]
    corpus = pq.read_table(args.data / "scifact" / "corpus.parquet").to_pydict()
    rows = np.random.default_rng(0).choice(len(corpus["text"]), args.passages, replace=False)
    passages = [f"{corpus['title'][i]} {corpus['text'][i]}" for i in rows]
    texts = {"STS-B sentences": sentences, "SciFact passages": passages}
    encoder = TransformerEncoder(args.model, "mean", precision="fp32")
    reference = {name: encoder.encode(t) for name, t in texts.items()}
    probes = [encoder.tokenizer([t], return_tensors="pt") for t in int8.PROBE_TEXTS]
    observed = int8.observe(encoder.model, lambda: [encoder.model(**p) for p in probes], torch)
    fp32_model = encoder.model
    out = []
    for variant, (a, w, per_tensor) in VARIANTS.items():
        encoder.model = int8.quantise(fp32_model, observed, torch, emulated_layer(torch, a, w))
        for name, module in encoder.model.named_modules():
            if per_tensor == "none" and hasattr(module, "per_token"):
                module.per_token = True
            elif per_tensor != "scheme" and any(name.endswith(end) for end in per_tensor.split(",")):
                module.per_token = False
        row: dict[str, Any] = {"variant": variant, "activation bits": a, "weight bits": w}
        for name, t in texts.items():
            got, want = encoder.encode(t).astype(np.float64), reference[name].astype(np.float64)
            cos = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
            row[f"{name} min cosine"], row[f"{name} mean cosine"] = float(cos.min()), float(cos.mean())
        out.append(row)
        print(row, flush=True)
    encoder.model = fp32_model
    return out


def speed(runs: int = 5) -> dict[str, float]:
    """Milliseconds of one (4,096 x 384) x (384 x 1,536) product per way, median of ``runs``."""
    import torch

    from retrieval.encode import int8

    rng = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 384, generator=rng)
    w = torch.randn(1536, 384, generator=rng)
    s8 = torch.randint(-127, 128, (1536, 384), dtype=torch.int8, generator=rng)
    ways = {"fp32 matmul": lambda: x @ w.T}
    a7 = torch.randint(0, 128, (4096, 384), dtype=torch.uint8, generator=rng)
    a8 = torch.randint(-127, 128, (4096, 384), dtype=torch.int8, generator=rng)
    ways["torch._int_mm (s8 x s8, exact)"] = lambda: torch._int_mm(a8, s8.T.contiguous())
    if int8.onednn_available(torch):
        packed = torch.ops.onednn.qlinear_prepack(s8, None)
        ones, zeros = torch.ones(1536), torch.zeros(1536, dtype=torch.long)
        ways["oneDNN u8 x s8, 7-bit inputs"] = lambda: torch.ops.onednn.qlinear_pointwise(
            a7, 1.0, 64, packed, ones, zeros, None, 1.0, 0, torch.float32, "none", [], ""
        )
    out = {}
    for name, way in ways.items():
        times = benchlib.repeat(way, runs=runs, warmup=1)
        out[name] = 1000 * benchlib.median(times)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="all-MiniLM-L6-v2")
    parser.add_argument("--sentences", type=int, default=1000, help="STS-B test sentences (distinct)")
    parser.add_argument("--passages", type=int, default=100, help="SciFact passages, a seeded sample")
    parser.add_argument("--data", type=Path, default=DATA, help="the shared evaluation data")
    parser.add_argument("--out", type=Path, default=None, help="default: results/encode")
    args = parser.parse_args()
    import torch

    from retrieval.encode import int8

    torch.set_num_threads(2)
    info = benchlib.machine(torch_too=True)
    benchlib.print_machine(info)
    saturates = bool(int8.onednn_available(torch) and int8.onednn_saturates(torch))
    rows = quality(args)
    benchlib.hold_bench_lock()
    start = time.perf_counter()
    timings = speed()
    print(timings, f"({time.perf_counter() - start:.0f} s)")
    out = args.out or benchlib.out_dir("encode")
    out.mkdir(parents=True, exist_ok=True)
    record = {"machine": info, "onednn_saturates": saturates, "quality": rows, "product_ms": timings}
    record |= {"sentences": args.sentences, "passages": args.passages, "model": args.model}
    benchlib.write_json(out / "int8-range.json", record)
    columns = [(k, k) for k in ("variant", "activation bits", "weight bits")]
    columns += [(f"{n} {m} cosine", f"{n}, {m}") for n in ("STS-B sentences", "SciFact passages") for m in ("min",)]
    columns += [(f"{n} mean cosine", f"{n}, mean") for n in ("STS-B sentences", "SciFact passages")]
    speed_rows = [{"product": name, "ms": ms, "x fp32": timings["fp32 matmul"] / ms} for name, ms in timings.items()]
    text = [
        f"# int8 at other widths: {args.model}, {args.sentences} sentences, {args.passages} passages\n",
        f"oneDNN's u8 x s8 product saturates on this CPU: {'yes' if saturates else 'no'}.\n",
        "Cosine of mean-pooled vectors against fp32, products emulated exactly (float64):\n",
        benchlib.md_table([{k: f"{v:.4f}" if "cosine" in k else v for k, v in r.items()} for r in rows], columns),
        "\nOne (4,096 x 384) x (384 x 1,536) product, 2 threads, median of 5:\n",
        benchlib.md_table(speed_rows, [("product", "product"), ("ms", "ms"), ("x fp32", "x fp32")]),
        "\n" + benchlib.machine_md(info),
    ]
    benchlib.write_md(out / "int8-range.md", "\n".join(text))
    print("\n".join(text))


if __name__ == "__main__":
    main()
