"""retrieval: whitened dense retrieval over parquet corpora (BERT-whitening, Su et al. 2021) with FAISS."""

from __future__ import annotations

import os

__version__ = "0.1.0"

# torch (the encoder) and FAISS (the search) each bring an OpenMP runtime, and both want the same cores. After a
# parallel region libgomp spins 300,000 times by default (~15 ms here) before its threads sleep, so a query's
# scan right after its encoding ran at half speed against torch's spinning threads. A short spin keeps both
# fast (flat 100k x 384 encode + scan: 16.6 -> 11 ms p50; batch encoding unchanged within noise). Read when
# libgomp loads, so it must be set before torch or FAISS is imported; a value the user set wins.
os.environ.setdefault("GOMP_SPINCOUNT", "20000")
