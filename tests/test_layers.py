"""The library's imports run one way (DESIGN §4): config/io -> data -> kernels -> models -> decoding ->
training -> eval -> serving (the SGLang plugin, optional) -> cli. Every `import` in every module of drelay/ (TYPE_CHECKING ones and imports
inside functions included) is parsed; one that reaches a higher layer fails, naming the file and the import."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "drelay"
# Layer of each unit, lowest first; a module may import its own layer and every lower one.
LAYERS = {"config": 0, "io": 0, "data": 1, "kernels": 2, "models": 3, "decoding": 4, "training": 5, "eval": 6,
          "serving": 7, "cli": 8, "__init__": 0}


def unit(module: str) -> str:
    """drelay.models.relay -> "models"; drelay.cli -> "cli"; drelay -> "__init__"."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def module_name(path: Path, package: Path = PACKAGE) -> str:
    rel = path.relative_to(package.parent).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def drelay_imports(path: Path) -> list[tuple[int, str]]:
    """(line, imported module) for every import of a drelay module in the file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "drelay"]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] == "drelay":
                found.append((node.lineno, node.module))
    return found


def upward_imports(package: Path = PACKAGE) -> list[str]:
    bad = []
    for path in sorted(package.rglob("*.py")):
        mine = unit(module_name(path, package))
        for line, imported in drelay_imports(path):
            theirs = unit(imported)
            if theirs not in LAYERS or mine not in LAYERS:
                bad.append(f"{path.relative_to(package.parent)}:{line}: {imported} (a unit with no layer: add it "
                           f"to LAYERS)")
            elif LAYERS[theirs] > LAYERS[mine]:
                bad.append(f"{path.relative_to(package.parent)}:{line}: imports {imported} "
                           f"({theirs}, layer {LAYERS[theirs]}) from {mine} (layer {LAYERS[mine]})")
    return bad


def test_no_module_imports_a_higher_layer():
    assert upward_imports() == []


def test_every_unit_has_a_layer():
    units = {unit(module_name(p)) for p in PACKAGE.rglob("*.py")}
    assert units <= set(LAYERS), units - set(LAYERS)


def test_the_check_finds_an_upward_import(tmp_path):
    """The check can fail: a kernels module that imports training is reported with its file and line."""
    fake = tmp_path / "drelay"
    (fake / "kernels").mkdir(parents=True)
    (fake / "kernels" / "bad.py").write_text("import torch\n\nfrom drelay.training.trainer import fit\n")
    (fake / "models").mkdir()
    (fake / "models" / "ok.py").write_text("from drelay.kernels.reference import dflash_ce\n")
    assert upward_imports(fake) == ["drelay/kernels/bad.py:3: imports drelay.training.trainer (training, layer 5) "
                                    "from kernels (layer 2)"]


def test_the_kernel_spec_loads_no_model_library():
    """Importing the references (what decoding and training take their acceptance and losses from) loads
    torch and the shared records only: not transformers, not the models."""
    code = ("import sys, drelay.kernels.reference, drelay.kernels.ops; "
            "print(sorted(m for m in sys.modules if m.startswith(('transformers', 'drelay.models', "
            "'drelay.decoding', 'drelay.training'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
