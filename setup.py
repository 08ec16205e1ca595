"""The package list, which pyproject.toml cannot compute: every package under medusa_like/ and medusa_like.conf (the
configs, mapped from conf/ by pyproject's package-dir); the checkout's train/, eval/ and benchmarks/ are left out.
Everything else about the build is in pyproject.toml."""

from setuptools import find_packages, setup

setup(packages=[*find_packages(include=["medusa_like", "medusa_like.*"]), "medusa_like.conf"])
