"""The shapes of the encoder's forward passes: length-sorted batches of a bounded set of shapes (``shape_batches``,
``padded_length``), and short texts packed several to a row (``pack_rows``, ``narrowest_rows``, ``pack_widths``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

# Padded lengths per doubling of the length (``padded_length``): more buckets, less padding, more shapes.
LENGTH_STEPS = 8
# Texts of at most PACK_MAX_TOKENS tokens are packed several to a row of at most PACK_TOKENS tokens (``pack_rows``),
# each attending only to itself: a CPU forward pass costs what its tokens cost, so the padding of a batch of short
# texts of mixed lengths (queries: median 13 tokens, p90 28, padded to the longest) was most of its work. Measured
# on 16 random SciFact/STS queries, MiniLM fp32, one thread: padded 20.0 ms a query, packed 8.7 (singles: ~18).
# Longer texts go in length-sorted padded batches, whose padding is small; a row's attention costs its length
# squared, which bounds PACK_TOKENS.
PACK_TOKENS = 256
PACK_MAX_TOKENS = 64
# Many short texts (a corpus of sentences, titles or questions) are packed in rows narrower than PACK_TOKENS: each
# text in rows of the narrowest of PACK_WIDTHS that holds two of it (``pack_widths``). A row's attention costs each
# of its tokens in proportion to the row's width, so 13-token sentences in rows of 256 spent ~20x the attention they
# need: 31% of an int8 forward pass over 300 STS-B sentences (MiniLM, 2 threads, oneDNN capped at AVX512_CORE_VNNI).
# A width gets rows of its own only for at least PACK_WIDTH_TOKENS tokens of texts; fewer join the next wider, so a
# few queries keep one forward pass of wide rows: each pass has a fixed cost, and 16 queries in two or three passes
# of narrow rows were 0.66-0.89x as fast as in one. scripts/bench_packing.py measures both layouts in one run
# (docs/benchmarks/packing.md).
PACK_WIDTHS = (32, 64, 128)
PACK_WIDTH_TOKENS = 1024
# The most padded tokens in one forward pass (``shape_batches``): 16 rows of 256 tokens, not 32. A batch's
# intermediate activations (tokens x 1,536 floats for MiniLM's feed-forward block) stay below glibc's largest mmap
# threshold (32 MB), so each pass reuses freed heap memory instead of mapping fresh pages and faulting them in:
# on SciFact passages (MiniLM, 2 threads, batch 32) fp32 8% and int8 32% faster than without a budget on an AMD
# EPYC with AVX2 (the levers ``lever_tokens*`` of scripts/bench_encode.py, docs/benchmarks/encode.md).
TOKEN_BUDGET = 4096


def pack_rows(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Indices of ``lengths`` in rows of at most ``capacity`` tokens each: first fit, longest first (each length
    must be at most ``capacity``). Rows are returned longest first; a row's texts, longest first."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda j: -lengths[j]):
        n = lengths[i]
        if n > capacity:
            raise ValueError(f"a text of {n} tokens does not fit a row of {capacity}")
        for r, free in enumerate(room):
            if n <= free:
                rows[r].append(i)
                room[r] -= n
                break
        else:
            rows.append([i])
            room.append(capacity - n)
    return sorted(rows, key=lambda row: -sum(lengths[i] for i in row))


def pack_widths(
    lengths: Sequence[int], capacity: int, widths: Sequence[int] = PACK_WIDTHS, least: int = PACK_WIDTH_TOKENS
) -> list[tuple[int, list[int]]]:
    """Indices of ``lengths`` (each at most ``capacity``) by the width of the rows they are packed in, narrowest
    first: each in the narrowest of ``widths`` (below ``capacity``) at least twice its length, else ``capacity``;
    a width's texts of fewer than ``least`` tokens in all join the next wider. ``widths`` empty: one width,
    ``capacity``, for every text."""
    usable = sorted(w for w in set(widths) if w < capacity) + [capacity]
    by_width: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        if n > capacity:
            raise ValueError(f"a text of {n} tokens does not fit a row of {capacity}")
        by_width.setdefault(next(w for w in usable if 2 * n <= w or w == capacity), []).append(i)
    out: list[tuple[int, list[int]]] = []
    carried: list[int] = []
    for width in usable:
        members = carried + by_width.get(width, [])
        if members and (width == capacity or sum(lengths[i] for i in members) >= least):
            out.append((width, members))
            carried = []
        else:
            carried = members
    return out


def narrowest_rows(lengths: Sequence[int], rows: list[list[int]], step: int = 8) -> list[list[int]]:
    """``rows`` (``pack_rows``'s) repacked into as many rows, as narrow as first fit manages: rows of one forward
    pass are all padded to the widest, so 16 queries of 330 tokens packed 242 + 88 cost two rows of 256, and
    evened out to two rows of ~165 cost two of 176 (a third fewer token slots; attention shrinks with the
    square). Tries widths from an even share upwards in ``step``s; ``rows`` when nothing narrower fits."""
    widest = max(sum(lengths[i] for i in row) for row in rows)
    width = max(max(lengths), -(-sum(lengths) // len(rows)))
    while width < widest:
        narrower = pack_rows(lengths, width)
        if len(narrower) <= len(rows):
            return narrower
        width += step
    return rows


def text_starts(packs: list[list[int]], ids: Sequence[Sequence[int]], width: int) -> list[int]:
    """The flat position (row * width + offset) of each packed text's first token, in packing order."""
    starts = []
    for row, pack in enumerate(packs):
        at = row * width
        for i in pack:
            starts.append(at)
            at += len(ids[i])
    return starts


def padded_length(n: int, max_length: int | None, per_doubling: int | None = None) -> int:
    """``n`` tokens rounded up to one of a few lengths: multiples of 8 up to 64, then ``per_doubling`` steps per
    doubling (LENGTH_STEPS: 64, 72, ... 128, 144, ... 256, 288, ...), so padding adds at most 1/8 of the length;
    never past ``max_length``. ``max_length`` None: ``n`` itself (no bucketing)."""
    if max_length is None:
        return n
    step = max(8, (1 << max(n - 1, 1).bit_length()) // (2 * (per_doubling or LENGTH_STEPS)))
    return min(-(-n // step) * step, max_length)


def shape_batches(
    lengths: Sequence[int], batch_size: int, max_length: int | None, token_budget: int | None = None
) -> list[tuple[np.ndarray, int]]:
    """Row numbers in batches, longest texts first, each with the length its batch is padded to.

    Sorting by length keeps padding small. The model sees a bounded set of input shapes, however varied the
    input: a batch has ``batch_size`` rows or a power of two fewer (a remainder of 13 goes as 8 + 4 + 1), and is
    padded to a ``padded_length`` bucket (``max_length`` None: to its longest row). Each new shape costs memory
    that a long-lived process never gives back (oneDNN kernels and scratch buffers, allocator fragmentation):
    unbounded shapes grew a server's RSS by ~2x over 5 minutes of varied requests (README, Serving).
    ``token_budget``: a batch whose ``batch_size`` rows would pad to more tokens than this takes the largest
    power of two of rows that fits (at least one), so long texts go in smaller batches (``TOKEN_BUDGET``).
    """
    order = np.argsort([-n for n in lengths], kind="stable")
    out: list[tuple[np.ndarray, int]] = []
    start = 0
    while start < len(order):
        left = len(order) - start
        width = padded_length(int(lengths[order[start]]), max_length)
        most = batch_size
        if token_budget is not None and batch_size * width > token_budget:
            most = 1 << (max(token_budget // width, 1).bit_length() - 1)
        rows = most if left >= most else 1 << (left.bit_length() - 1)
        out.append((order[start : start + rows], width))
        start += rows
    return out


def packed_batch(
    packs: list[list[int]], width: int, ids: Sequence[Sequence[int]], pad_id: int, offset: int, bf16: bool, torch: Any
) -> tuple[dict[str, Any], Any]:
    """One forward pass's inputs for ``packs`` (each a row of several texts, padded to ``width``) and each token's
    text number (padding: the number of texts).

    Each text keeps its own positions (from ``offset``: 0, or the model's padding index + 1) and attends only to
    its own tokens (a block-diagonal additive mask, in the model's dtype), so it gets the states it would get
    alone; padding attends to itself only.
    """
    n_texts = sum(len(pack) for pack in packs)
    input_ids = torch.full((len(packs), width), pad_id, dtype=torch.long)
    positions = torch.zeros((len(packs), width), dtype=torch.long)
    segment = torch.full((len(packs), width), n_texts, dtype=torch.long)
    n = 0
    for row, pack in enumerate(packs):
        at = 0
        for i in pack:
            length = len(ids[i])
            input_ids[row, at : at + length] = torch.tensor(ids[i])
            positions[row, at : at + length] = torch.arange(length) + offset
            segment[row, at : at + length] = n
            at += length
            n += 1
    own = segment[:, :, None] == segment[:, None, :]
    own |= torch.eye(width, dtype=torch.bool)[None]  # padding sees itself: no row of the mask is all -inf
    dtype = torch.bfloat16 if bf16 else torch.float32
    mask = torch.zeros(own.shape, dtype=dtype).masked_fill_(~own, torch.finfo(dtype).min)[:, None]
    batch = {
        "input_ids": input_ids,
        "attention_mask": mask,
        "position_ids": positions,
        "token_type_ids": torch.zeros_like(input_ids),
    }
    return batch, segment


def pool_packed(
    result: Any,
    segment: Any,
    packs: list[list[int]],
    ids: Sequence[Sequence[int]],
    width: int,
    poolings: Sequence[str],
    torch: Any,
) -> dict[str, Any]:
    """Each packed text's pooled vector (float32, in packing order) from a forward pass over ``packed_batch``."""
    n_texts = sum(len(pack) for pack in packs)
    flat = segment.reshape(-1)
    counts = torch.bincount(flat, minlength=n_texts + 1)[:n_texts, None].float()

    def mean(states: Any) -> Any:
        sums = torch.zeros((n_texts + 1, states.shape[-1]))
        return sums.index_add_(0, flat, states.reshape(-1, states.shape[-1]).float())[:n_texts] / counts

    out = {}
    for p in poolings:
        if p == "cls":  # each text's first token: its row's start plus the lengths before it in the row
            first = torch.tensor(text_starts(packs, ids, width))
            out[p] = result.last_hidden_state.reshape(-1, result.last_hidden_state.shape[-1])[first].float()
        elif p == "mean":
            out[p] = mean(result.last_hidden_state)
        else:  # first-last-avg: hidden_states[1] and [-1]
            out[p] = (mean(result.hidden_states[1]) + mean(result.hidden_states[-1])) / 2
    return out
