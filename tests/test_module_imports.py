"""`import probjax_nn` stays free of Flax and Equinox; each framework loads only with its own submodule."""

import subprocess
import sys

import pytest

pytest.importorskip("flax")
pytest.importorskip("equinox")

_SCRIPT = """
import sys
import probjax_nn
assert "flax" not in sys.modules and "equinox" not in sys.modules, "probjax_nn imported a framework"
import probjax_nn.nnx
assert "equinox" not in sys.modules
import probjax_nn.equinox
import equinox
assert probjax_nn.equinox.eqx is equinox and equinox.__name__ == "equinox"  # the real package, not our file
"""


def test_frameworks_load_only_with_their_submodule():
    subprocess.run([sys.executable, "-c", _SCRIPT], check=True)  # no timeout: a slow machine is no failure
