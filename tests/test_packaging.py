"""What autopar installs next to other packages: its only top-level import name is ``autopar``.

A top-level package under a common name shadows the project of that name. Our Triton kernels once
sat in a top-level ``kernels`` package; transformers 5.25 requires Hugging Face's ``kernels`` and
imported ours instead (ImportError on every GPT-2 / LLaMA build)."""
from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_wheel_ships_only_the_autopar_package():
    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    assert find["include"] == ["autopar*"]


def test_no_importable_package_at_the_repository_root_but_autopar():
    """``python -m pytest`` and ``python -m autopar`` put the repository root first on sys.path:
    any folder there with an ``__init__.py`` would shadow an installed package of its name."""
    packages = sorted(p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file())
    assert packages == ["autopar"]


def test_kernels_import_from_autopar():
    from autopar.kernels import registry
    assert Path(registry.__file__).resolve().parent == ROOT / "autopar" / "kernels"
