"""docs/compile/index.md from the compile report's JSON (scripts/compile_report.py)."""
from __future__ import annotations


def markdown(report: dict, problems: list[str]) -> str:
    return "# Compile report\n\n" + "\n".join(f"- {p}" for p in problems) + "\n"
