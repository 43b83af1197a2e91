"""The manifest: what an index directory holds, how it was made, and checksums to prove it is intact."""

from __future__ import annotations

import datetime as dt
import importlib.metadata
import json
import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from retrieval.errors import IndexDirError
from retrieval.files import sha256

SCHEMA_VERSION = 1
MANIFEST_NAME = "manifest.json"
TRANSFORM_NAME = "transform.npz"
MOMENTS_NAME = "moments.npz"
INDEX_NAME = "index.faiss"
DOCS_NAME = "docs.parquet"
STASH_DIR = "vectors"


@dataclass
class Manifest:
    """Self-description of an index directory (``manifest.json``). Sections are plain JSON dicts."""

    encoder: dict[str, Any]
    transform: dict[str, Any]
    index: dict[str, Any]
    corpus: dict[str, Any]
    stash: dict[str, Any] | None = None
    timings: dict[str, float] = field(default_factory=dict)
    files: dict[str, dict[str, Any]] = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=dict)
    created: str = ""
    schema_version: int = SCHEMA_VERSION

    @property
    def n(self) -> int:
        return int(self.index["ntotal"])

    def save(self, directory: Path) -> None:
        """Checksum every listed file not yet recorded, then write ``manifest.json`` (itself not listed).

        A record already present is kept as it is: ``add`` and ``refit`` carry over those of the stash's parts,
        which are written once and never changed, so a small update does not re-hash the whole stash.
        """
        for name, record in self.files.items():
            if not record:
                self.files[name] = file_record(directory / name)
        self.created = self.created or dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
        self.versions = self.versions or library_versions()
        text = json.dumps(asdict(self), indent=2, sort_keys=False)
        (directory / MANIFEST_NAME).write_text(text + "\n")

    @classmethod
    def load(cls, directory: Path) -> Manifest:
        directory = Path(directory)
        path = directory / MANIFEST_NAME
        if not directory.is_dir():
            raise IndexDirError(f"no index directory at {directory}; build one with `retrieval index CORPUS`")
        if not path.is_file():
            raise IndexDirError(f"{directory} has no {MANIFEST_NAME}: it is not a complete index; rebuild it")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise IndexDirError(f"{path} is not valid JSON ({err}); the index is corrupt, rebuild it") from err
        version = data.get("schema_version")
        if version != SCHEMA_VERSION:
            raise IndexDirError(
                f"{directory} has index schema version {version}; this retrieval reads version {SCHEMA_VERSION}: "
                "rebuild the index with this version"
            )
        try:
            return cls(**data)
        except TypeError as err:
            raise IndexDirError(f"{path} lacks required fields ({err}); rebuild the index") from err

    def verify(self, directory: Path, names: list[str] | None = None) -> None:
        """Check size and sha256 of the named files (all listed files by default)."""
        for name in names if names is not None else list(self.files):
            expected = self.files.get(name)
            path = Path(directory) / name
            if expected is None:
                raise IndexDirError(f"{directory}/{MANIFEST_NAME} does not list {name}; rebuild the index")
            if not path.is_file():
                raise IndexDirError(f"index file {path} is missing; rebuild the index with --overwrite")
            if path.stat().st_size != expected["bytes"] or sha256(path) != expected["sha256"]:
                raise IndexDirError(
                    f"index file {path} is corrupt or truncated (checksum mismatch); rebuild the index with --overwrite"
                )


def is_index_dir(path: Path) -> bool:
    """True only for a directory whose manifest says this tool built it (what ``--overwrite`` may replace)."""
    manifest = Path(path) / MANIFEST_NAME
    if Path(path).is_symlink() or not Path(path).is_dir() or not manifest.is_file():
        return False
    try:
        data = json.loads(manifest.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return (
        isinstance(data, dict)
        and isinstance(data.get("schema_version"), int)
        and all(isinstance(data.get(key), dict) for key in ("encoder", "transform", "index", "corpus"))
        and "retrieval" in (data.get("versions") or {})
    )


def stash_part_records(old: Manifest, names: list[str]) -> dict[str, dict[str, Any]]:
    """``names`` as new records to fill, except the stash parts ``old`` already recorded (immutable files)."""
    immutable = f"{STASH_DIR}/part-"
    return {name: dict(old.files.get(name, {})) if name.startswith(immutable) else {} for name in names}


def file_record(path: Path) -> dict[str, Any]:
    return {"bytes": path.stat().st_size, "sha256": sha256(path)}


def library_versions() -> dict[str, str]:
    import faiss
    import numpy
    import pyarrow

    import retrieval

    versions = {
        "retrieval": retrieval.__version__,
        "python": platform.python_version(),
        "numpy": numpy.__version__,
        "faiss": faiss.__version__,
        "pyarrow": pyarrow.__version__,
    }
    for name in ("torch", "transformers"):
        try:  # from the installed metadata: importing torch just to read its version costs seconds
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return versions
