"""mindzero's package. It installs beside the user's MindSpore: the one requirement on MindSpore is the oldest
version the suite ran on (mindzero/core/versions.py holds it with the versions tested), so pip leaves any later
MindSpore in place. What only the tests or the examples need is in the extras ``test`` and ``examples``."""
import re
import runpy
from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).resolve().parent
VERSIONS = runpy.run_path(str(HERE / "mindzero" / "core" / "versions.py"))  # pure: imports nothing of mindzero
VERSION = re.search(r'^__version__ = "([^"]+)"', (HERE / "mindzero" / "__init__.py").read_text(), re.M).group(1)

setup(
    name="mindzero",
    version=VERSION,
    description="ZeRO (stages 0-3) for MindSpore data-parallel training",
    long_description=(HERE / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["mindzero", "mindzero.*"]),
    python_requires=">=3.9",
    # numpy<2: MindSpore 2.10 fails under NumPy 2 although its metadata allows it (2.7-2.9 declare numpy<2 themselves)
    install_requires=[VERSIONS["MINDSPORE_REQUIREMENT"], "numpy<2", "pyyaml", "psutil", "tqdm"],
    extras_require={
        "examples": ["matplotlib>=3.7,<4"],
        # mindone's optimizers (CAME, Muon) are installed without mindone's own dependencies by scripts/setup_env.sh
        "test": ["pytest", "pytest-xdist==3.6.1", "matplotlib>=3.7,<4", "mindcv==0.3.0"],
    },
    entry_points={"console_scripts": ["mindzero-merge=mindzero.checkpoint.cli:main_merge",
                                      "mindzero-reshard=mindzero.checkpoint.cli:main_reshard",
                                      "mindzero-verify=mindzero.checkpoint.cli:main_verify",
                                      "mindzero-estimate=mindzero.core.estimate:main",
                                      "mindzero-plan=mindzero.planner.cli:main",
                                      "mindzero-env=mindzero.env:main"]},
)
