"""The registry of repair methods (drelay/models/repair.py has the interface) and the one holder of a
method under decoding: its drafter, the method and a fingerprint of the files they came from.

Everything above the models (engine, replay, evaluation, training, CLI) reaches a method through
`method_class(name)` and the interface, never through its class or name.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from torch import nn

from drelay.io import folder_fingerprint
from drelay.models.cpu_linear import use_few_row_linear
from drelay.models.drafter import BlockDrafter
from drelay.models.heads import HEADS
from drelay.models.relay import DRelay, DRelayLite
from drelay.models.repair import Native, Oracle, RepairMethod
from drelay.models.target import Target

METHODS: dict[str, type[RepairMethod]] = {cls.name: cls for cls in (Native, DRelay, DRelayLite, *HEADS.values(), Oracle)}
TRAINABLE = tuple(name for name, cls in METHODS.items() if cls.trainable)
DRAFTER_FOLDER = "drafter"  # <joint.out_dir>/<name>/drafter: every trained method's backbone


def method_class(name: str) -> type[RepairMethod]:
    if name not in METHODS:
        raise ValueError(f"unknown repair method {name!r}; known: {', '.join(METHODS)}")
    return METHODS[name]


def create_method(name: str, drafter: BlockDrafter, settings, pool_size: int, seed: int) -> RepairMethod:
    """A fresh, trainable method `name` for `drafter`; settings: its joint.<name> section."""
    cls = method_class(name)
    if not cls.trainable:
        raise ValueError(f"{name} is not a trainable method (trainable: {', '.join(TRAINABLE)})")
    return _few_row(cls.create(drafter, settings, pool_size, seed))


def load_method(name: str, method_dir: str | Path, embed_tokens: nn.Module) -> RepairMethod:
    """The method `name` saved under `method_dir` (<joint.out_dir>/<name>), bound to `embed_tokens`."""
    cls = method_class(name)
    folder = Path(method_dir) / cls.folder_name if cls.folder_name else method_dir
    return _few_row(cls.load(folder, embed_tokens).eval())


def _few_row(method: RepairMethod) -> RepairMethod:
    """The method's linears take the few-row fp32 rule when it is on, as the target's and the drafter's do
    (drelay/models/cpu_linear.py, opt-in): a repair at decoding multiplies a block's few rows by vocabulary-wide
    (DSpark's bigram, Domino's residual) or reader-sized weights."""
    use_few_row_linear(method)
    return method


def save_method(method: RepairMethod, method_dir: str | Path) -> None:
    if method.folder_name:
        method.save(Path(method_dir) / method.folder_name)


@dataclass
class Speculator:
    """A method under decoding: a drafter, its repair method, and a fingerprint of the files they came
    from (a changed model invalidates what was measured with it)."""

    drafter: BlockDrafter
    method: RepairMethod
    fingerprint: str = ""


def load_speculator(target: Target, joint_dir: str | Path, name: str, oracle_drafter: str = "dflash") -> Speculator:
    """Trained method `name` from <joint_dir>/<name>/ (drafter + the method's folder); the oracle (and any
    method that is not trained) on the drafter of `oracle_drafter`."""
    cls = method_class(name)
    folder = Path(joint_dir) / (name if cls.trainable else oracle_drafter)
    drafter = BlockDrafter.load(folder / DRAFTER_FOLDER, target).eval()
    if not cls.trainable:
        return Speculator(drafter, cls().eval(), folder_fingerprint(folder / DRAFTER_FOLDER))
    return Speculator(drafter, load_method(name, folder, target.embed_tokens), folder_fingerprint(folder))
