"""``ds_dynatrain.__version__`` and ``dynatrain --version``.

Oracles: the ``[project]`` table of the repository's ``pyproject.toml`` (read with ``tomllib``), the
installed distributions' metadata, and torch's and DeepSpeed's own ``__version__``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from importlib import metadata

import pytest
from conftest import ROOT, _env

tomllib = pytest.importorskip("tomllib", reason="tomllib (the oracle) is in the standard library from Python 3.11")


def _project_version() -> str:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["project"]["version"]


def test_version_is_the_projects():
    import ds_dynatrain

    assert ds_dynatrain.__version__ == _project_version()
    assert ds_dynatrain.__version__ == metadata.version("ds_dynatrain")  # installed in this environment
    assert "__version__" in ds_dynatrain.__all__


def test_a_source_tree_that_is_not_installed_reads_its_pyproject():
    """Without site-packages (``python -S``) no distribution is installed: the version comes from
    the source tree's ``pyproject.toml`` (version.py imports nothing outside the standard library)."""
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('v', {os.path.join(ROOT, 'ds_dynatrain', 'version.py')!r})\n"
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
        "print(m.package_version()); print(m.installed_version('torch'))\n"
    )
    out = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == [_project_version(), "None"]


def test_source_tree_version_reads_only_this_projects_table(tmp_path):
    from ds_dynatrain.version import _source_tree_version

    ours = tmp_path / "ours.toml"
    ours.write_text('[build-system]\nversion = "9"\n\n[project]\nname = "ds_dynatrain"\nversion = "1.2.3"\n\n[x]\n')
    assert _source_tree_version(str(ours)) == "1.2.3"
    other = tmp_path / "other.toml"
    other.write_text('[project]\nname = "another"\nversion = "4.5.6"\n')
    assert _source_tree_version(str(other)) is None
    assert _source_tree_version(str(tmp_path / "missing.toml")) is None


def test_dynatrain_version_names_the_versions_it_runs_on():
    import deepspeed
    import torch

    out = subprocess.run(
        [sys.executable, "-m", "ds_dynatrain.cli", "--version"],
        capture_output=True,
        text=True,
        timeout=300,  # it imports torch and DeepSpeed: tens of seconds on a busy 2-core host
        cwd=ROOT,
        env=_env(),
    )
    assert out.returncode == 0, out.stderr
    python = ".".join(map(str, sys.version_info[:3]))
    versions = f"torch {torch.__version__}, deepspeed {deepspeed.__version__}, Python {python}"
    expected = f"dynatrain {_project_version()} ({versions})"
    assert out.stdout.strip().splitlines()[-1] == expected
