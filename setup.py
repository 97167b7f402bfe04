"""Package list for setuptools; all other metadata is in pyproject.toml.

`[tool.setuptools.packages.find]` can only find packages under their own folder names, but the
top-level `kernels/` folder installs as `tlt_trainers.kernels` (see `package-dir` in pyproject.toml).
Listing the packages here keeps new subpackages of either folder included automatically.
"""

from setuptools import find_packages, setup

packages = find_packages(include=["tlt_trainers", "tlt_trainers.*"])
packages += ["tlt_trainers.kernels"] + [f"tlt_trainers.kernels.{p}" for p in find_packages("kernels")]

setup(packages=packages)
