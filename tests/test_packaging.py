"""What a wheel carries: every file of the package that is not Python (the demo model, the kernels' C++ sources,
the dashboard) is matched by pyproject.toml's package-data, so a regular install has them, not only an editable one."""

from __future__ import annotations

import fnmatch
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_package_data_covers_every_non_python_file():
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["strata"]
    package = ROOT / "strata"
    files = [p.relative_to(package).as_posix() for p in package.rglob("*")
             if p.is_file() and p.suffix not in (".py", ".pyc") and "__pycache__" not in p.parts]
    assert files, "the package has data files (the demo model, csrc, static)"
    # setuptools' package-data globs match within one directory level, like fnmatch with '/' kept literal
    missed = [f for f in files if not any(fnmatch.fnmatch(f, g) and f.count("/") == g.count("/") for g in globs)]
    assert not missed, f"not in pyproject.toml's package-data: {missed}"
