"""docs/from_pytorch.md runs: its python blocks, in order, in one namespace."""

import pathlib
import re

PAGE = pathlib.Path(__file__).resolve().parent.parent / "docs" / "from_pytorch.md"


def test_the_page_runs():
    blocks = re.findall(r"^```python\n(.*?)^```$", PAGE.read_text(), flags=re.S | re.M)
    assert len(blocks) >= 9
    namespace = {}
    for number, block in enumerate(blocks):
        exec(compile(block, f"{PAGE.name} block {number}", "exec"), namespace)  # noqa: S102
