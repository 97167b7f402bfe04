"""Package list for setuptools; all other metadata is in pyproject.toml."""

from setuptools import find_packages, setup

setup(packages=find_packages(include=["tlt_trainers", "tlt_trainers.*"]))
