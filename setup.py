from setuptools import find_packages, setup

setup(
    name="mindzero",
    version="0.1.0",
    description="ZeRO (stages 0-3) for MindSpore data-parallel training",
    packages=find_packages(include=["mindzero", "mindzero.*"]),
    python_requires=">=3.9",
    install_requires=["mindspore==2.10.0", "numpy<2", "pyyaml", "tqdm"],
    extras_require={"test": ["pytest"]},
    entry_points={"console_scripts": ["mindzero-merge=mindzero.checkpoint.cli:main_merge",
                                      "mindzero-reshard=mindzero.checkpoint.cli:main_reshard",
                                      "mindzero-verify=mindzero.checkpoint.cli:main_verify",
                                      "mindzero-estimate=mindzero.core.estimate:main",
                                      "mindzero-plan=mindzero.planner.cli:main"]},
)
