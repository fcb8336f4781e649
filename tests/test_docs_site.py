"""The documentation site builds with `mkdocs build --strict`: every page in the nav, no broken link, and an API
reference rendered from the docstrings (mkdocstrings reads the source; nothing is imported)."""

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

pytest.importorskip("material", reason="the dev extra installs mkdocs-material")
pytest.importorskip("mkdocstrings_handlers.python", reason="the dev extra installs mkdocstrings[python]")


def test_the_site_builds_strictly_with_an_api_reference(tmp_path):
    site = tmp_path / "site"
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
         "--site-dir", str(site)],
        cwd=tmp_path, env=env, capture_output=True, text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    reference = (site / "api" / "probjax_kernels" / "index.html").read_text()
    for name in ("probjax_kernels.flash_attention", "probjax_kernels.flex_attention", "probjax_kernels.FlashConfig"):
        assert f'id="{name}"' in reference, name
    assert 'id="probjax_nn.nnx.MultiHeadAttention"' in (site / "api" / "nnx" / "index.html").read_text()
    assert (site / "contributing" / "index.html").exists()
