"""docs/reference.md is what the code says: every public name with its signature and docstring's first paragraph,
every command-line tool's --help, every environment variable mindzero or its tests read (scripts/reference.py)."""
import re
import subprocess
import sys
from pathlib import Path

import mindzero
from mindzero.core.options import VARIABLES

ROOT = Path(__file__).resolve().parents[2]
PAGE = (ROOT / "docs" / "reference.md").read_text()


def test_the_page_is_generated_from_the_code():
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "reference.py"), "--check"], capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]


def test_every_public_name_tool_and_variable_is_on_the_page():
    for name in mindzero.__all__:
        assert f"### `{name}`" in PAGE, name
    setup = (ROOT / "setup.py").read_text()
    for script in re.findall(r'"(mindzero-[a-z]+)=', setup):
        assert f"### `{script}`" in PAGE, script
    for variable in VARIABLES:
        assert f"| `{variable.name}` |" in PAGE, variable.name


def test_every_mindzero_variable_the_sources_read_is_in_the_table():
    """A ``MINDZERO_*`` name in a string of mindzero's or the tests' sources is in :data:`VARIABLES` (the table the
    page is generated from), and the table names no variable the sources do not read."""
    found = set()
    for path in [*(ROOT / "mindzero").rglob("*.py"), *(ROOT / "tests").rglob("*.py")]:
        if path.name == "test_reference.py":
            continue
        found |= set(re.findall(r"""["'$]\{?(MINDZERO_[A-Z_]+)""", path.read_text()))
    listed = {v.name for v in VARIABLES if v.name.startswith("MINDZERO_")}
    assert found == listed
