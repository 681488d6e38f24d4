"""The README and the pages of docs/ as text, for the tests that take commands, code and tables out of them."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
DOCS = REPO / "docs"
_HEADING = re.compile(r"^(#{1,6}) (.*)$")


def page(name: str) -> str:
    """The text of docs/<name> (e.g. `criteo.md`)."""
    return (DOCS / name).read_text(encoding="utf-8")


def headings(text: str) -> list[tuple[int, int, str]]:
    """(line index, level, title) of each Markdown heading outside fenced code."""
    out, fence = [], False
    for i, line in enumerate(text.splitlines()):
        if line.startswith("```"):
            fence = not fence
        elif not fence and (m := _HEADING.match(line)):
            out.append((i, len(m.group(1)), m.group(2).strip()))
    return out


def section(text: str, title: str) -> str:
    """The section headed `title` (any level), up to the next heading of the same or a higher level."""
    lines = text.splitlines(keepends=True)
    found = [(i, level) for i, level, t in headings(text) if t == title]
    assert len(found) == 1, f"expected one heading {title!r}, found {len(found)}"
    start, level = found[0]
    end = next((i for i, lv, _ in headings(text) if i > start and lv <= level), len(lines))
    return "".join(lines[start:end])


def fenced(text: str, lang: str) -> list[str]:
    """The bodies of the ```lang blocks of `text`, in order."""
    return re.findall(rf"^```{re.escape(lang)}\n(.*?)^```", text, re.S | re.M)


def bash_commands(text: str) -> list[list[str]]:
    """Each command of the ```bash blocks as argv: `\\` continuations joined, `# comments` dropped, `a && b` split."""
    commands = []
    for block in fenced(text, "bash"):
        for line in block.replace("\\\n", " ").splitlines():
            argv = shlex.split(line, comments=True)
            while "&&" in argv:
                cut = argv.index("&&")
                commands.append(argv[:cut])
                argv = argv[cut + 1:]
            if argv:
                commands.append(argv)
    return commands
