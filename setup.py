"""Packages of the wheel (the rest is in pyproject.toml).

``jaxcoll`` and its subpackages, plus the runner's ``experiments/`` and the
training ``configs/`` of the checkout, installed as ``jaxcoll/_shipped/``
(the console scripts of :mod:`jaxcoll.cli` run them from there), so that
``pip install .`` gives the runner and its configs with the library.
"""

from setuptools import find_packages, setup

SHIPPED = {"jaxcoll._shipped.experiments": "experiments", "jaxcoll._shipped.configs": "configs"}

# Directories of data files are packages too (setuptools warns otherwise).
DATA = ["jaxcoll.comm_model.tuning_tables"]

setup(
    packages=[*find_packages(include=["jaxcoll", "jaxcoll.*"]), *DATA, *SHIPPED],
    package_dir=SHIPPED,
)
