"""Write the configuration reference (every field, type, default, docstring) into docs/configuration.md.

    python scripts/config_reference.py          # rewrite docs/configuration.md between the markers
    python scripts/config_reference.py --check  # exit 1 if docs/configuration.md is out of date (the tests run this)
"""

from __future__ import annotations

import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.config import SECTIONS, Config, field_docs  # noqa: E402
from engine.config.loading import _field_type, _type_name  # noqa: E402

DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "configuration.md")
START, END = "<!-- config-reference:start -->", "<!-- config-reference:end -->"


def reference() -> str:
    defaults = Config()
    out = []
    for section, cls in SECTIONS.items():
        out += [f"**[{section}]**", "", "| key | type | default | meaning |", "|---|---|---|---|"]
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            default = getattr(getattr(defaults, section), f.name)
            doc = docs[f.name].replace("|", "\\|")
            out.append(f"| `{f.name}` | {_type_name(_field_type(cls, f.name))} | `{default!r}` | {doc} |")
        out.append("")
    return "\n".join(out)


def render(text: str) -> str:
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{reference()}{END}{tail}"


def main() -> int:
    with open(DOC) as f:
        text = f.read()
    new = render(text)
    if "--check" in sys.argv:
        if new != text:
            print("docs/configuration.md's config reference is out of date: run python scripts/config_reference.py")
            return 1
        return 0
    with open(DOC, "w") as f:
        f.write(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
