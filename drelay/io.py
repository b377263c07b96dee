"""Reading and writing record files, and finding data: the offline mirror first, then the HF hub.

Record files are JSON Lines (one object per line, optionally gzipped) or one JSON array. Writes
go to a temporary file that is renamed into place, so an interrupted write leaves nothing behind.
Every parse error names the file and the line.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import importlib.util
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

MIRROR_FIX = (
    "Fix: set data.mirror in params.yaml to a folder holding benchmarks/ and train_prompts/ "
    "(the offline copies), or install `datasets` on a machine with network access."
)


class DataNotFoundError(FileNotFoundError):
    """Neither the mirror file nor a hub copy could be read; the message says which and how to fix it."""


class DataFormatError(ValueError):
    """A data file that is not what it should be; the message names the file and line or record."""


def _to_dict(record: Any) -> dict:
    return dataclasses.asdict(record) if dataclasses.is_dataclass(record) else dict(record)


def write_jsonl(records: Iterable[Any], path: str | Path) -> Path:
    """One JSON object per line (dataclasses become dicts); parents are created, the write is atomic."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for record in records:
                f.write(json.dumps(_to_dict(record), ensure_ascii=False) + "\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def read_jsonl(path: str | Path) -> list[dict]:
    """The objects of a JSONL file (`.gz` is unzipped); blank lines are skipped."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    records = []
    with opener(path, "rt", encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataFormatError(f"{path}: line {line_no}: not valid JSON ({e.msg})") from None
            if not isinstance(record, dict):
                raise DataFormatError(f"{path}: line {line_no}: expected a JSON object, got {type(record).__name__}")
            records.append(record)
    return records


def read_json(path: str | Path) -> list[dict]:
    """The objects of a file holding one JSON array of objects."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise DataFormatError(f"{path}: line {e.lineno}, column {e.colno}: not valid JSON ({e.msg})") from None
    if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
        raise DataFormatError(f"{path}: expected a JSON array of objects")
    return data


def read_records(path: str | Path) -> list[dict]:
    """A `.json` array or a `.jsonl` / `.jsonl.gz` file, by its name."""
    return read_json(path) if Path(path).suffix == ".json" else read_jsonl(path)


@dataclass(frozen=True)
class HubSource:
    """Where the same data lives on the HF hub: `load_dataset(id, config, split=split)`."""

    id: str
    config: str | None
    split: str


def load_rows(path: Path, hub: HubSource | None) -> list[dict]:
    """The records of mirror file `path` if it exists, else the hub copy, else DataNotFoundError."""
    if path.is_file():
        return read_records(path)
    if hub is None:
        raise DataNotFoundError(f"mirror file {path} not found, and this data has no hub copy. {MIRROR_FIX}")
    missing = f"mirror file {path} not found"
    if importlib.util.find_spec("datasets") is None:
        raise DataNotFoundError(
            f"{missing}, and the hub copy {hub.id} needs the `datasets` package, which is not installed. "
            f"{MIRROR_FIX}"
        )
    from datasets import load_dataset

    try:
        return [dict(row) for row in load_dataset(hub.id, hub.config, split=hub.split)]
    except Exception as e:  # no network, gated set, renamed split: all end the same way
        raise DataNotFoundError(f"{missing}, and loading {hub.id} from the hub failed ({e}). {MIRROR_FIX}") from e


def json_digest(value: Any, length: int = 16) -> str:
    """sha256 of `value` as sorted-key JSON, its first `length` hex digits."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:length]


def folder_fingerprint(path: str | Path) -> str:
    """sha256 over every file under `path` (relative names and contents)."""
    digest = hashlib.sha256()
    root = Path(path)
    for file in sorted(p for p in root.rglob("*") if p.is_file()):
        digest.update(str(file.relative_to(root)).encode())
        with open(file, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()[:16]
