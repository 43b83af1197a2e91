"""OpenVINO as an int8 path for all-MiniLM-L6-v2: against torch fp32 and the library's own fp32 and int8 encoders.

One run, the same texts for every variant (``VARIANTS``): torch fp32 as sentence-transformers computes it (Hugging
Face AutoModel + mean pooling), the library's encoder at precision fp32 and int8 (its ``--precision int8`` path:
``retrieval.encode.int8``), and the model exported to OpenVINO: fp32 (``INFERENCE_PRECISION_HINT`` f32), static
int8 by NNCF (``nncf.quantize``, model type TRANSFORMER; and with the feed-forward down projection and attention
output kept fp32), and int8 weights alone (``nncf.compress_weights``, symmetric) with the CPU plugin's dynamic
quantisation of activations (``DYNAMIC_QUANTIZATION_GROUP_SIZE`` 64 and 128). Calibration texts are STS-B dev
sentences and SciFact passages outside the evaluated sample.

- quality: min and mean cosine of mean-pooled vectors against torch fp32 (batch 32, length-sorted) on STS-B test
  sentences and a seeded sample of SciFact passages (title + text);
- speed: texts/s from text to vector (tokenisation included), batch 32, ``--threads`` threads, on the first 300
  sentences and 48 passages of those, length-sorted; median of 3 interleaved runs after a warm-up, under the
  benchmark lock. torch and OpenVINO run batches padded to each batch's longest text; the library's encoder its own
  (length-sorted, shape-bucketed, short texts packed);
- kernels: per OpenVINO variant, the FullyConnected layers' execution type (``primitiveType``) and precision in the
  compiled model's runtime model; per torch variant, oneDNN's verbose log of one batch. OpenVINO names its
  dynamic-quantisation kernels ``brgemm_avx512_f32`` with int8 weights: their inner products are int8 (``vpdpbusd``
  in a disassembly of the JIT code, no AMX tiles), which the table calls VNNI.

``--cap-isa AVX512_CORE_VNNI`` emulates a CPU with VNNI but no bf16 or AMX: the script re-executes itself with
``ONEDNN_MAX_CPU_ISA`` (and ``OV_CPU_MAX_ISA``) set, which torch's oneDNN and OpenVINO's bundled one both honour.
Needs openvino and nncf, not dependencies of the project:

    python -m venv --system-site-packages .venv-openvino && .venv-openvino/bin/pip install openvino nncf
    .venv-openvino/bin/python scripts/probe_openvino.py                             # -> results/encode/openvino.*
    .venv-openvino/bin/python scripts/probe_openvino.py --cap-isa AVX512_CORE_VNNI  # -> ..._isa_avx512_core_vnni.*
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_encode  # noqa: E402
import benchlib  # noqa: E402

SETUP = (
    "python -m venv --system-site-packages .venv-openvino && .venv-openvino/bin/pip install openvino nncf, "
    "then .venv-openvino/bin/python scripts/probe_openvino.py"
)
# name -> (OpenVINO model, DYNAMIC_QUANTIZATION_GROUP_SIZE, description); model None: a torch variant
VARIANTS: dict[str, tuple[str | None, int, str]] = {
    "torch_fp32": (None, 0, "Hugging Face AutoModel + mean pooling (what sentence-transformers computes)"),
    "ours_fp32": (None, 0, "the library's encoder, precision fp32"),
    "ours_int8": (None, 0, "the library's encoder, precision int8 (retrieval.encode.int8)"),
    "ov_fp32": ("fp32", 0, "OpenVINO, INFERENCE_PRECISION_HINT f32"),
    "ov_ptq": ("ptq", 0, "nncf.quantize, model type TRANSFORMER (static int8 activations and weights)"),
    "ov_ptq_fp32_down_attnout": ("ptq_keep", 0, "ov_ptq, the FFN down projection and attention output kept fp32"),
    "ov_wint8_dq64": ("wint8", 64, "nncf.compress_weights INT8_SYM, dynamic quantisation, group 64"),
    "ov_wint8_dq128": ("wint8", 128, "nncf.compress_weights INT8_SYM, dynamic quantisation, group 128"),
}
KEEP_FP32 = [r".*layer\.\d+\.output\.dense.*", r".*attention\.output\.dense.*"]  # FFN down, attention output


def calibration_texts(n_sentences: int, n_passages: int, evaluated: set[str], seed: int = 1) -> list[str]:
    """STS-B dev sentences and SciFact passages outside the evaluated sample: never a text that is measured."""
    t = pq.read_table(bench_encode.DATA / "sts" / "stsb-dev.parquet", columns=["sentence1", "sentence2"]).to_pydict()
    sentences = [s for s in dict.fromkeys(t["sentence1"] + t["sentence2"]) if s not in evaluated]
    docs = [d for d in bench_encode.load_texts("passages", 1 << 30, 0) if d not in evaluated]  # the whole corpus
    rng = np.random.default_rng(seed)
    picked = rng.choice(len(sentences), n_sentences, replace=False), rng.choice(len(docs), n_passages, replace=False)
    return [sentences[i] for i in picked[0]] + [docs[i] for i in picked[1]]


def batches(tokenizer: Any, texts: list[str], max_length: int, size: int) -> tuple[np.ndarray, list[dict]]:
    """Length-sorted batches padded to each one's longest text: (order, int64 arrays per batch)."""
    tokens = tokenizer(texts, truncation=True, max_length=max_length)
    lengths = np.array([len(ids) for ids in tokens["input_ids"]])
    order = np.argsort(-lengths, kind="stable")
    out = []
    for start in range(0, len(texts), size):
        rows = order[start : start + size]
        batch = {k: np.zeros((len(rows), lengths[rows].max()), np.int64) for k in ("input_ids", "token_type_ids")}
        for r, i in enumerate(rows):
            batch["input_ids"][r, : lengths[i]] = tokens["input_ids"][i]
            batch["token_type_ids"][r, : lengths[i]] = tokens["token_type_ids"][i]
        batch["attention_mask"] = (np.arange(batch["input_ids"].shape[1]) < lengths[rows, None]).astype(np.int64)
        out.append(batch)
    return order, out


def padded_encoder(tokenizer: Any, max_length: int, forward: Callable[[dict], Any]) -> Callable[[list[str]], Any]:
    """texts -> mean-pooled vectors in input order, ``forward`` (batch -> last hidden state) on padded batches."""
    import torch

    from retrieval.encode.pooling import masked_mean

    def encode(texts: list[str]) -> np.ndarray:
        order, parts = batches(tokenizer, texts, max_length, 32)
        with torch.inference_mode():
            pooled = [masked_mean(torch.as_tensor(forward(b)), torch.from_numpy(b["attention_mask"])) for b in parts]
        out = np.empty((len(texts), pooled[0].shape[1]), dtype=np.float32)
        out[order] = torch.cat(pooled).numpy()
        return out

    return encode


def openvino_models(hf_model: Any, calibration: list[dict], torch: Any) -> tuple[dict[str, Any], dict[str, float]]:
    """The fp32 model exported to OpenVINO and its int8 variants (``VARIANTS``); seconds each took to make."""
    import nncf
    import openvino as ov

    class LastHidden(torch.nn.Module):  # type: ignore[misc, name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.bert = hf_model

        def forward(self, input_ids: Any, attention_mask: Any, token_type_ids: Any) -> Any:
            return self.bert(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)[0]

    start, seconds = time.perf_counter(), {}
    example = {k: torch.from_numpy(v) for k, v in calibration[0].items()}
    names = ("input_ids", "attention_mask", "token_type_ids")
    fp32 = ov.convert_model(LastHidden(), example_input=example, input=[(n, [-1, -1], ov.Type.i64) for n in names])
    seconds["export"], models = time.perf_counter() - start, {"fp32": fp32}
    ptq: dict[str, Any] = {"model_type": nncf.ModelType.TRANSFORMER, "subset_size": len(calibration)}
    keep = nncf.IgnoredScope(patterns=KEEP_FP32, validate=True)  # a pattern matching nothing is an error
    ways: dict[str, Callable[[Any], Any]] = {
        "ptq": lambda m: nncf.quantize(m, nncf.Dataset(calibration), **ptq),
        "ptq_keep": lambda m: nncf.quantize(m, nncf.Dataset(calibration), ignored_scope=keep, **ptq),
        "wint8": lambda m: nncf.compress_weights(m, mode=nncf.CompressWeightsMode.INT8_SYM),
    }
    for name, way in ways.items():
        start = time.perf_counter()
        models[name] = way(fp32.clone())
        seconds[name] = time.perf_counter() - start
    return models, seconds


def capture_onednn(run: Callable[[], Any], torch: Any) -> dict[str, int]:
    """Matrix-product kernels oneDNN ran in ``run()`` (from its verbose log, which it prints to stdout)."""
    libc = ctypes.CDLL(None)
    sys.stdout.flush()
    saved = os.dup(1)
    with tempfile.TemporaryFile("w+") as log:
        os.dup2(log.fileno(), 1)
        try:
            with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
                run()
        finally:
            libc.fflush(None)
            os.dup2(saved, 1)
            os.close(saved)
        log.seek(0)
        fields = [line.split(",") for line in log.read().splitlines()]
    ops = ("matmul", "inner_product", "convolution")
    keep = [f for f in fields if len(f) > 8 and f[3] == "exec" and f[5] in ops]
    return dict(Counter(f"{f[5]} {f[6]} {f[8].split()[0].rsplit(':', 4)[0]}" for f in keep))  # "src:u8"


def openvino_kernels(compiled: Any) -> dict[str, int]:
    """FullyConnected / MatMul layers of the runtime model (after an inference) by execution type and precision."""
    counts: Counter[str] = Counter()
    for op in compiled.get_runtime_model().get_ordered_ops():
        info = op.get_rt_info()
        if info["layerType"].astype(str) in ("FullyConnected", "MatMul"):
            kind = info["layerType"].astype(str)
            counts[f"{kind} {info['primitiveType'].astype(str)}/{info['runtimePrecision'].astype(str)}"] += 1
    return dict(counts)


def matrix_unit(kernels: dict[str, int], group: int) -> str:
    """What the matrix products ran on, from the kernels' names: AMX, AVX-512 VNNI (int8) or fp32."""
    names = " ".join(kernels).lower()
    if not kernels:
        return "fp32 (MKL / BLAS: no oneDNN product)"
    if "f32/i8" in names:  # OpenVINO: int8 weights, kernels named after their fp32 input
        return "AVX-512 VNNI int8, dynamic quantisation" if group else "fp32, int8 weights decompressed"
    int8, mixed = any(t in names for t in ("i8", "u8", "s8")), " + fp32" if "f32/f32" in names else ""
    if "amx" in names:
        return ("AMX int8" if int8 else "AMX bf16") + mixed
    if int8:
        unit = "AVX-512 VNNI int8" if "vnni" in names or benchlib.cpu()["vnni"] else "AVX-512 int8 (no VNNI)"
        return unit + mixed
    return "fp32"


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="all-MiniLM-L6-v2", help="model name or local folder (default: %(default)s)")
    p.add_argument("--cap-isa", default=None, help="emulate a CPU: cap oneDNN's instruction set (AVX512_CORE_VNNI)")
    p.add_argument("--sentences", type=int, default=1000, help="STS-B test sentences for quality (distinct)")
    p.add_argument("--passages", type=int, default=100, help="SciFact passages for quality, a seeded sample")
    p.add_argument("--speed-sentences", type=int, default=300, help="the first of those timed (default: 300)")
    p.add_argument("--speed-passages", type=int, default=48, help="the first of those timed (default: 48)")
    p.add_argument("--threads", type=int, default=2, help="torch and OpenVINO threads (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per cell; the median is reported")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", type=Path, default=bench_encode.DATA, help="the shared evaluation data")
    p.add_argument("--out", type=Path, default=None, help="output path without suffix (default: results/encode/)")
    args = p.parse_args()
    if args.cap_isa and os.environ.get(benchlib.ISA_CAP_ENV) != args.cap_isa:  # before torch or openvino loads
        env = {**os.environ, benchlib.ISA_CAP_ENV: args.cap_isa, "OV_CPU_MAX_ISA": args.cap_isa}
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
    capped = os.environ.get(benchlib.ISA_CAP_ENV)
    try:
        import nncf
        import openvino as ov
    except ImportError as err:
        raise SystemExit(f"openvino and nncf are needed ({err}): set up with `{SETUP}`") from None
    bench_encode.DATA = args.data
    benchlib.hold_bench_lock()  # timed, and the calibration takes every core: never beside another benchmark
    import torch

    from retrieval.encode.models import default_max_length, load_pretrained
    from retrieval.encode.precision import INT8_MIN_COSINE
    from retrieval.encode.transformer import TransformerEncoder

    torch.set_num_threads(args.threads)
    nncf.set_log_level(logging.WARNING)
    info = benchlib.machine(torch_too=True)
    info["openvino"], info["nncf"] = ov.get_version(), nncf.__version__
    benchlib.print_machine(info)
    folder, tokenizer, hf_model = load_pretrained(args.model)
    max_length = default_max_length(folder, tokenizer.model_max_length)
    sentences = bench_encode.load_texts("sentences", args.sentences, args.seed)
    passages = bench_encode.load_texts("passages", args.passages, args.seed)
    quality_sets = {"sentences": sentences, "passages": passages}
    speed_sets = {"sentences": sentences[: args.speed_sentences], "passages": passages[: args.speed_passages]}
    calibration = calibration_texts(300, 200, set(sentences + passages))
    calibration_batches = [batches(tokenizer, [t], max_length, 1)[1][0] for t in calibration]  # no padding
    models, make_seconds = openvino_models(hf_model, calibration_batches, torch)
    core, encoders, compiled = ov.Core(), {}, {}
    encoders["torch_fp32"] = padded_encoder(tokenizer, max_length, lambda b: hf_model(**_tensors(b, torch))[0])
    for precision in ("fp32", "int8"):
        encoders[f"ours_{precision}"] = TransformerEncoder(args.model, precision=precision, batch_size=32).encode
    for name, (model, group, _) in VARIANTS.items():
        if model is None:
            continue
        config = {"INFERENCE_NUM_THREADS": args.threads, "NUM_STREAMS": 1, "PERFORMANCE_HINT": "LATENCY"}
        config |= {"INFERENCE_PRECISION_HINT": "f32", "DYNAMIC_QUANTIZATION_GROUP_SIZE": group}
        compiled[name] = core.compile_model(models[model], "CPU", config)
        encoders[name] = padded_encoder(tokenizer, max_length, _infer(compiled[name].create_infer_request()))
    print(f"\n[quality] {len(sentences)} sentences, {len(passages)} passages, against torch fp32", flush=True)
    reference = {k: encoders["torch_fp32"](texts) for k, texts in quality_sets.items()}
    rows: list[dict[str, Any]] = []
    for name, (model, group, what) in VARIANTS.items():
        row: dict[str, Any] = {"variant": name, "description": what}
        for key, texts in quality_sets.items():
            cos = bench_encode.cosines(encoders[name](texts), reference[key])
            row[f"{key}_cos_min"], row[f"{key}_cos_mean"] = float(cos.min()), float(cos.mean())
        if model is None:
            row["kernels"] = capture_onednn(partial(encoders[name], speed_sets["passages"][:32]), torch)
        else:
            row["kernels"] = openvino_kernels(compiled[name])  # the quality run has run it
            group = int(compiled[name].get_property("DYNAMIC_QUANTIZATION_GROUP_SIZE"))  # as the plugin took it
            row["dynamic_quantization_group_size"] = group
        row["matrix_unit"] = matrix_unit(row["kernels"], group)
        row["passes_int8_bar"] = min(row["sentences_cos_min"], row["passages_cos_min"]) >= INT8_MIN_COSINE
        rows.append(row)
        print(f"  {name:26s} min cos {row['sentences_cos_min']:.4f} / {row['passages_cos_min']:.4f}  "
              f"{row['matrix_unit']}  {row['kernels']}", flush=True)  # fmt: skip
    print(f"\n[speed] {', '.join(f'{len(t)} {k}' for k, t in speed_sets.items())}, batch 32, {args.threads} threads")
    for _ in range(2):  # warm-up: every batch shape of every variant, twice
        for name in VARIANTS:
            for texts in speed_sets.values():
                encoders[name](texts)
    times: dict[tuple[str, str], list[float]] = {}
    order = np.random.default_rng(args.seed)
    cells = [(name, key) for name in VARIANTS for key in speed_sets]
    tokenise = {
        k: benchlib.median(benchlib.repeat(partial(tokenizer, t, truncation=True, max_length=max_length), 3))
        for k, t in speed_sets.items()
    }
    for repeat in range(args.repeats):  # interleaved, a fresh order each repeat: drifting load hits all alike
        for i in order.permutation(len(cells)):
            name, key = cells[i]
            start = time.perf_counter()
            encoders[name](speed_sets[key])
            times.setdefault((name, key), []).append(time.perf_counter() - start)
        print(f"  repeat {repeat + 1}/{args.repeats} done, load {os.getloadavg()[0]:.1f}", flush=True)
    for row in rows:
        for key, texts in speed_sets.items():
            row[f"{key}_seconds_all"] = times[(row["variant"], key)]
            row[f"{key}_texts_per_s"] = len(texts) / benchlib.median(times[(row["variant"], key)])
            row[f"{key}_vs_torch_fp32"] = row[f"{key}_texts_per_s"] / rows[0][f"{key}_texts_per_s"]
    stem = "openvino" + (f"_isa_{capped.lower()}" if capped else "")
    out = args.out or benchlib.out_dir("encode") / stem
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "command": benchlib.command_line(),
        "machine": info,
        "model": args.model,
        "max_length": max_length,
        "onednn_max_cpu_isa": capped,
        "emulated_cpu": bool(capped),
        "settings": {k: os.path.relpath(v, benchlib.REPO) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "calibration": "300 STS-B dev sentences + 200 SciFact passages outside the evaluated sample, one text a batch",
        "make_seconds": make_seconds,
        "tokeniser_texts_per_s": {k: len(speed_sets[k]) / v for k, v in tokenise.items()},
        "rows": rows,
    }
    benchlib.write_json(out.with_suffix(".json"), record)
    columns = [("variant", "variant"), ("matrix_unit", "matrix products on")]
    columns += [(f"{k}_cos_{m}", f"{k} {m} cos") for k in quality_sets for m in ("min", "mean")]
    columns += [("passes_int8_bar", f"min cos >= {INT8_MIN_COSINE}")]
    columns += [
        (f"{k}_{v}", f"{k} {h}")
        for k in speed_sets
        for v, h in (("texts_per_s", "texts/s"), ("vs_torch_fp32", "x torch"))
    ]
    shown = [{k: f"{v:.4f}" if "_cos_" in k else v for k, v in r.items()} for r in rows]  # 0.9996 is not 1.000
    kernel_rows = [
        {"variant": r["variant"], "kernels": ", ".join(f"{n} x {k}" for k, n in r["kernels"].items())} for r in rows
    ]
    emulated = (
        f"**Emulated CPU**: `ONEDNN_MAX_CPU_ISA={capped}` (and `OV_CPU_MAX_ISA`) caps oneDNN's instruction set in "
        "torch and in OpenVINO's bundled oneDNN: a CPU with VNNI but no bf16 or AMX. MKL's fp32 products are not."
        if capped
        else "Native CPU: no instruction set capped."
    )
    text = [
        f"# OpenVINO as an int8 path: {args.model}\n\n`{record['command']}`\n",
        emulated + "\n",
        f"Quality: cosine of mean-pooled vectors against torch fp32 on {len(sentences)} STS-B test sentences and "
        f"{len(passages)} SciFact passages. Speed: text to vector, batch 32, {args.threads} threads, "
        f"{len(speed_sets['sentences'])} sentences and {len(speed_sets['passages'])} passages, median of "
        f"{args.repeats} interleaved runs after a warm-up; tokenising alone: "
        + ", ".join(f"{k} {v:,.0f} texts/s" for k, v in record["tokeniser_texts_per_s"].items())
        + ".\n",
        benchlib.md_table(shown, columns),
        "\n## Variants\n\n" + "\n".join(f"- `{k}`: {v[2]}" for k, v in VARIANTS.items()),
        "\n## Kernels (OpenVINO: runtime model's FullyConnected execution type / precision; torch: oneDNN's log)\n",
        benchlib.md_table(kernel_rows, [("variant", "variant"), ("kernels", "matrix-product kernels")]),
        "\nOne-time cost, seconds: " + ", ".join(f"{k} {v:.1f}" for k, v in make_seconds.items()),
        "\n" + benchlib.machine_md(info) + f"\n- OpenVINO {info['openvino']}, NNCF {info['nncf']}",
    ]
    benchlib.write_md(out.with_suffix(".md"), "\n".join(text))
    print("\n" + benchlib.md_table(shown, columns) + f"\n\nwrote {out}.json, .md")


def _infer(request: Any) -> Callable[[dict], Any]:
    """An OpenVINO infer request as batch -> last hidden state."""
    return lambda batch: request.infer(batch)[0]


def _tensors(batch: dict[str, np.ndarray], torch: Any) -> dict[str, Any]:
    return {k: torch.from_numpy(v) for k, v in batch.items()}


if __name__ == "__main__":
    main()
