"""Prints the commands of README.md's first ```bash block, one per line, without trailing `# comments`.

CI runs what this prints, so the README's commands are the ones tested: change them there, not here.
"""

import sys


def comment_start(line: str):
    """Index of a `#` that starts a shell comment (outside quotes, after whitespace), or None."""
    quote = None
    for i, c in enumerate(line):
        if quote:
            quote = None if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c == "#" and (i == 0 or line[i - 1].isspace()):
            return i
    return None


def readme_commands(text: str) -> list:
    lines = text.splitlines()
    start = lines.index("```bash") + 1
    block = lines[start:lines.index("```", start)]
    cut = [line[:comment_start(line)] if comment_start(line) is not None else line for line in block]
    return [c.strip() for c in cut if c.strip()]


if __name__ == "__main__":
    with open(sys.argv[1] if len(sys.argv) > 1 else "README.md", encoding="utf-8") as f:
        print("\n".join(readme_commands(f.read())))
