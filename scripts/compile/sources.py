"""What the compile checks' `--reuse` needs of the checkout and the machine, with no jax: the checkout's folder, the
regex that takes the machine's folders out of the kernels' source file names, and the commit that picks the units
compiled again."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]  # the checkout: this file is scripts/compile/sources.py


def source_paths_regex(*roots: Path) -> str:
    """A regex of the folders that differ between machines (`roots`: the checkout, a toolchain; and any
    site-packages), which `JAX_HLO_SOURCE_FILE_CANONICALIZATION_REGEX` strips from the file names of the lowered
    kernels' source locations: the same kernel then lowers to the same module wherever it is compiled."""
    spellings = sorted({re.escape(str(s)) for root in roots for s in (root, Path(root).resolve())}, key=len,
                       reverse=True)
    return f"^(?:{'|'.join(spellings)}|.*/site-packages)/"


def head_commit(repo: Path) -> str:
    """`repo`'s commit (the seed of the units `--verify` compiles again), "" outside a git checkout."""
    result = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True)
    return result.stdout.strip() if result.returncode == 0 else ""
