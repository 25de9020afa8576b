"""The examples use mindzero as users do: ``import mindzero`` and the names of ``mindzero.__all__`` only (pure: their
sources are read, not run)."""
import ast
from pathlib import Path

import pytest

import mindzero

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))


def mindzero_uses(source: str) -> tuple:
    """``(imports of a mindzero module other than the package, names read as mindzero.<name>)``."""
    tree = ast.parse(source)
    deep, names = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "mindzero":
            deep.append(node.module)
        elif isinstance(node, ast.Import):
            deep += [a.name for a in node.names if a.name.startswith("mindzero.")]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "mindzero":
            names.add(node.attr)
    return deep, names


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_an_example_uses_the_public_api_only(path):
    deep, names = mindzero_uses(path.read_text())
    assert deep == [], f"{path.name} imports mindzero's internals: {deep}"
    assert names <= set(mindzero.__all__), f"{path.name} reads names outside mindzero.__all__: {names - set(mindzero.__all__)}"


def test_the_check_finds_an_internal_import():
    deep, names = mindzero_uses("import mindzero\nfrom mindzero.comm import AllGather\nmindzero.prepare_train_network\n"
                                "mindzero.engine.x\n")
    assert deep == ["mindzero.comm"] and names == {"prepare_train_network", "engine"}
