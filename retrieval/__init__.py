"""retrieval: whitened dense retrieval over parquet corpora (BERT-whitening, Su et al. 2021) with FAISS."""

from __future__ import annotations

__version__ = "0.1.0"
