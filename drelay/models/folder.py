"""Save and load a model as a folder: config.json (its config dataclass) + model.safetensors.

Shared by the drafter and the relay, so both fail the same clear way on a missing folder, a
corrupt config or truncated weights.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from safetensors.torch import load_file, save_file
from torch import nn

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"


def save_folder(module: nn.Module, config, path: str | Path) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / CONFIG_NAME).write_text(json.dumps(asdict(config), indent=2))
    save_file({k: v.detach().contiguous().cpu() for k, v in module.state_dict().items()}, path / WEIGHTS_NAME)
    return path


def load_folder(path: str | Path, module_cls, config_cls, error_cls: type[Exception], what: str):
    """`module_cls(config_cls(**config.json))` with the saved weights, in eval mode, on the CPU."""
    path = Path(path)
    try:
        values = json.loads((path / CONFIG_NAME).read_text())
        for old, new in getattr(config_cls, "renamed_keys", {}).items():  # folders saved before a rename
            if old in values and new not in values:
                values[new] = values.pop(old)
        config = config_cls(**values)
    except FileNotFoundError as err:
        raise error_cls(f"no {what} at {path}: {CONFIG_NAME} is missing") from err
    except (json.JSONDecodeError, TypeError, ValueError) as err:
        raise error_cls(f"corrupt {what} config {path / CONFIG_NAME}: {err}") from err
    module = module_cls(config)
    try:
        module.load_state_dict(load_file(path / WEIGHTS_NAME))
    except Exception as err:  # safetensors raises several types for a truncated or missing file
        raise error_cls(f"cannot read {what} weights {path / WEIGHTS_NAME}: {err}") from err
    return module.eval()


@dataclass
class SharedEmbedding:
    """The target's frozen input embedding, held by reference (never saved with a head)."""

    embed_tokens: nn.Module


class EmbeddingBoundFolder:
    """Save/load for a repair head (an nn.Module) bound to the target's embedding by `attach`.
    A subclass sets `config_cls` and `folder_error` and names itself in `folder_what()`."""

    config_cls: type
    folder_error: type[Exception] = RuntimeError

    @classmethod
    def folder_what(cls) -> str:
        return cls.__name__

    def save(self, path: str | Path) -> Path:
        return save_folder(self, self.config, path)

    @classmethod
    def load(cls, path: str | Path, embed_tokens: nn.Module | None = None):
        """Load a saved head; with `embed_tokens` it moves to that embedding's device/dtype and binds it."""
        module = load_folder(path, cls, cls.config_cls, cls.folder_error, cls.folder_what())
        if embed_tokens is None:
            return module
        w = embed_tokens.weight
        return module.to(device=w.device, dtype=w.dtype).attach(embed_tokens)
