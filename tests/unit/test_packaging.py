"""The install a new user gets: every test extra is bounded above (the newest release in range is what
a fresh virtual environment takes, so an unbounded one lets a new release break the README's test
command on a new machine while CI's older packages stay green), and the packages installed here are
inside those ranges."""

from __future__ import annotations

import tomllib
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from packaging.requirements import Requirement

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def _requirements(group: str | None) -> list[Requirement]:
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    texts = project["dependencies"] if group is None else project["optional-dependencies"][group]
    return [Requirement(text) for text in texts]


def test_every_test_extra_has_an_upper_bound():
    unbounded = [str(req) for req in _requirements("test")
                 if not any(spec.operator in ("<", "<=", "==", "~=") for spec in req.specifier)]
    assert not unbounded


def test_installed_packages_are_in_the_declared_ranges():
    outside = []
    for req in _requirements(None) + _requirements("test"):
        if req.marker is not None and not req.marker.evaluate():
            continue
        try:
            installed = version(req.name)
        except PackageNotFoundError:
            continue  # an optional extra this environment did not install
        if not req.specifier.contains(installed, prereleases=True):
            outside.append(f"{req.name} {installed} not in {req.specifier}")
    assert not outside
