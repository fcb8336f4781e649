"""Shared by the LM example's tests (tests/test_examples*.py, tests/test_multiprocess.py)."""

from __future__ import annotations

import sysconfig
from pathlib import Path

# The runs' corpus: asyncio's sources (33 files, 0.5 MB). The default corpus, the whole standard library, is
# listed and stat-ed file by file on every run (about a second of CPU in every process that trains):
# test_examples.py's test_sample_takes_explicit_zeros_and_names_bad_flags alone trains on it.
SMALL_CORPUS = str(Path(sysconfig.get_paths()["stdlib"]) / "asyncio")
