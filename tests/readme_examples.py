"""Examples the README shows, read from the README itself (so the tests keep them true)."""
from __future__ import annotations

import re
from pathlib import Path

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def _toml_block() -> str:
    m = re.search(r"```toml\n(.*?)```", README, re.S)
    if m is None:
        raise AssertionError("the README lost its cluster TOML example")
    return "\n".join(line[2:] if line.startswith("  ") else line for line in m.group(1).splitlines()) + "\n"


README_POD = _toml_block()      # the cluster file of the README's --cluster section
