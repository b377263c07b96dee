"""CPU-only import shims for SGLang in tests (never used by drelay/serving itself).

SGLang 0.5.23 imports `torchvision.transforms` at module level on the worker's import path
(sglang.srt.configs: its multimodal configs, e.g. nano_nemotron_vl, deepseek_ocr). PyPI's torchvision
wheels are CUDA builds whose C extension cannot load next to the CPU torch 2.13 wheel, so on
a CPU machine `.venv-sglang` has no torchvision. This shim registers an inert `torchvision`
whose attributes raise on use: the text-only paths the tests drive never touch it, and a
multimodal code path that did would fail loudly instead of running on a fake.
A GPU host installs the real torchvision, and then the shim is never installed.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types


SHIMMED_MODULE = "sglang.srt.configs"  # its multimodal configs import torchvision.transforms


class _Unavailable(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        raise RuntimeError(f"{self.__name__}.{name}: torchvision is a CPU-test shim here (tests/serving/cpu_stubs.py)")


def preimport_without_torchvision() -> bool:
    """Import SGLang's one torchvision-at-import-time module under a temporary shim, then take the
    shim away again (so transformers' own `find_spec("torchvision")` sees none and keeps its image
    paths off). True when the shim was needed."""
    if importlib.util.find_spec("torchvision") is not None:
        try:
            import torchvision  # noqa: F401
            return False
        except Exception:  # noqa: BLE001 - a CUDA build next to the CPU torch
            for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
                del sys.modules[name]
    import sglang  # noqa: F401 - imports transformers, whose availability checks must not see the shim
    import transformers  # noqa: F401

    names = ("torchvision", "torchvision.transforms", "torchvision.transforms.functional")
    for name in names:
        module = _Unavailable(name)
        module.__path__ = []  # a package, so its submodules resolve from sys.modules
        sys.modules[name] = module
    sys.modules["torchvision"].transforms = sys.modules["torchvision.transforms"]
    sys.modules["torchvision.transforms"].functional = sys.modules["torchvision.transforms.functional"]
    # the one name read at import time (a default argument)
    mode = types.SimpleNamespace(BICUBIC="bicubic", BILINEAR="bilinear", NEAREST="nearest")
    sys.modules["torchvision.transforms.functional"].InterpolationMode = mode
    sys.modules["torchvision.transforms"].InterpolationMode = mode
    try:
        importlib.import_module(SHIMMED_MODULE)
    finally:
        for name in names:
            sys.modules.pop(name, None)
    return True


def native_rotary_embedding() -> None:
    """SGLang's RotaryEmbedding picks vllm's kernel on a host that is neither CUDA nor its CPU engine
    (SGLANG_USE_CPU_ENGINE=1, which needs sgl_kernel's CPU build); mark the host as CPU for the rotary
    layer only, so it runs its own torch `forward_native` path."""
    import sglang.srt.layers.rotary_embedding.base as rotary_base

    rotary_base._is_cpu = True
