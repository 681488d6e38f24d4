"""The README and docs/: the site builds with `mkdocs build --strict` (a broken link, a missing page or a page left out
of the nav fails it), every page is reachable from docs/index.md, every relative link and #anchor resolves, the README
stays short and keeps CI's two commands first, the spec page's field table is TrainConfig's fields (each one's flag
or `--set` as its `SettingDoc.flag` says) and its launcher table is LAUNCH_SETTINGS, and every psworker command
shown in a code block parses with the current flags, none of them an old spelling."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from psworker import cli
from psworker.models import registry
from psworker.cli.flags import LAUNCH_SETTINGS
from psworker.spec.train_config import TrainConfig, setting_doc
from tests import docs_pages
from tests.docs_pages import DOCS, README, REPO

README_MAX_LINES = 300
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
# the programs whose command lines are psworker's: the argv that psworker's parser gets
ENTRY_POINTS = {"psworker": [], ".venv/bin/psworker": [], "launch/start_ps.sh": ["ps"],
                "launch/start_worker.sh": ["worker"]}
NOT_COMMANDS = ("python", "yaml", "text", "json")    # blocks of these languages hold no shell commands
COMMAND_LINE = re.compile(r"^([A-Z_]+=\S* )*(%s) " % "|".join(map(re.escape, ENTRY_POINTS)))


def pages() -> list[Path]:
    return sorted(DOCS.glob("*.md"))


def prose(text: str) -> str:
    """`text` without fenced code blocks and inline code spans (where a `[x](y)` is no link)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def slug(title: str) -> str:
    """A heading's anchor as GitHub and MkDocs' toc make it (code marks dropped, punctuation out, spaces to -)."""
    text = re.sub(r"[^\w\- ]", "", title.replace("`", "").strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    return {slug(title) for _, _, title in docs_pages.headings(path.read_text(encoding="utf-8"))}


def links(path: Path) -> list[str]:
    """The relative targets of `path`'s Markdown links (web addresses left out)."""
    return [t for t in LINK.findall(prose(path.read_text(encoding="utf-8"))) if not re.match(r"^[a-z]+:", t)]


def test_the_site_builds_strictly(tmp_path):
    """MkDocs is in the `test` extra; `--strict` turns its warnings (a link to a missing page or anchor, a page not
    in the nav) into a failed build."""
    pytest.importorskip("mkdocs", reason="MkDocs is not installed: pip install -e '.[test]'")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--config-file",
                           str(REPO / "mkdocs.yml"), "--site-dir", str(tmp_path / "site")],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "site" / "index.html").is_file()


def test_every_page_is_in_the_nav_and_reachable_from_the_index():
    def nav_pages(nav) -> set[str]:
        if isinstance(nav, str):
            return {nav}
        items = nav.values() if isinstance(nav, dict) else nav
        return set().union(*(nav_pages(item) for item in items))

    config = yaml.safe_load((REPO / "mkdocs.yml").read_text())
    assert config["docs_dir"] == "docs"
    names = {p.name for p in pages()}
    assert nav_pages(config["nav"]) == names
    seen, todo = set(), ["index.md"]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        todo += [t.split("#")[0] for t in links(DOCS / name) if t.split("#")[0].endswith(".md")]
    assert names - seen == set(), f"not reachable from docs/index.md: {sorted(names - seen)}"
    index = {t.split("#")[0] for t in links(DOCS / "index.md")}
    assert names - {"index.md"} <= index, f"not listed in docs/index.md: {sorted(names - index - {'index.md'})}"


def test_the_readme_is_short_and_keeps_ci_s_two_commands_first():
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= README_MAX_LINES, f"README.md has {len(text.splitlines())} lines"
    assert text.startswith("# psworker\n\n```bash\n")
    sys.path.insert(0, str(REPO / ".ci"))
    try:
        from readme_commands import readme_commands
    finally:
        sys.path.remove(str(REPO / ".ci"))
    first, second = readme_commands(text)
    assert first.endswith(".venv/bin/psworker local cluster_specs/local.yaml"), first
    assert second.endswith(".venv/bin/python -m pytest"), second


@pytest.mark.parametrize("path", [README, *pages()], ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_relative_link_and_anchor_resolves(path):
    broken = []
    for target in links(path):
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            broken.append(f"{target}: no {dest.relative_to(REPO) if dest.is_relative_to(REPO) else dest}")
        elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest)):
            broken.append(f"{target}: no heading with that anchor")
    assert not broken, f"{path.relative_to(REPO)}: " + "; ".join(broken)


def test_the_spec_page_lists_every_train_field_and_no_other():
    section = docs_pages.section(docs_pages.page("spec.md"), "The `train` section")
    listed = re.findall(r"^\| `(\w+)` \|", section, re.M)
    fields = [f.name for f in dataclasses.fields(TrainConfig)]
    assert len(listed) == len(set(listed)), f"listed twice: {sorted({n for n in listed if listed.count(n) > 1})}"
    assert set(listed) == set(fields), (f"missing from docs/spec.md: {sorted(set(fields) - set(listed))}; "
                                        f"not TrainConfig fields: {sorted(set(listed) - set(fields))}")


def test_the_spec_page_says_which_train_fields_are_flags():
    """The field table's *set with* column is each field's `SettingDoc.flag`: its own flag, `--set`, or (the two
    checkpoint intervals) `--checkpoint_every`."""
    section = docs_pages.section(docs_pages.page("spec.md"), "The `train` section")
    listed = dict(re.findall(r"^\| `(\w+)` \| `([^`]+)` \|", section, re.M))
    assert len(listed) == len(dataclasses.fields(TrainConfig)), sorted(listed)
    for name, how in listed.items():
        if name.startswith("save_checkpoint_"):
            want = "--checkpoint_every"
        else:
            want = f"--{name}" if setting_doc(name).flag else "--set"
        assert how == want, f"docs/spec.md says {name} is set with {how}; SettingDoc.flag says {want}"


def test_the_spec_page_lists_exactly_the_launcher_settings():
    section = docs_pages.section(docs_pages.page("spec.md"), "Launcher settings")
    table = section.split("### ")[0]
    listed = re.findall(r"^\| `(\w+)` \|", table, re.M)
    missing, extra = sorted(set(LAUNCH_SETTINGS) - set(listed)), sorted(set(listed) - set(LAUNCH_SETTINGS))
    assert sorted(listed) == sorted(LAUNCH_SETTINGS), f"missing: {missing}; not launcher settings: {extra}"


def shown_commands() -> list[tuple[str, dict[str, str], list[str]]]:
    """(where, environment assignments, psworker argv) of each psworker command in a code block of the README and the
    docs (`\\` continuations joined, `# comments` dropped, `a && b` split)."""
    found = []
    for path in [README, *pages()]:
        text = path.read_text(encoding="utf-8")
        for lang, body in re.findall(r"^```(\w*)\n(.*?)^```", text, re.S | re.M):
            if lang in NOT_COMMANDS:
                continue
            if lang != "bash":    # a console's block: its command lines among the output
                lines = body.replace("\\\n", " ").splitlines()
                body = "\n".join(line for line in lines if COMMAND_LINE.match(line))
            for argv in docs_pages.bash_commands(f"```bash\n{body}\n```"):
                env = {}
                while argv and re.match(r"^[A-Z_]+=", argv[0]):
                    key, _, value = argv.pop(0).partition("=")
                    env[key] = value
                if argv and argv[0] in ENTRY_POINTS:
                    found.append((f"{path.relative_to(REPO)}: {shlex.join(argv)}", env,
                                  ENTRY_POINTS[argv[0]] + argv[1:]))
    return found


def plugin_module(name: str) -> str:
    """The `# <name>.py:` python block of the docs: a model module that a shown command names in PSWORKER_MODELS."""
    blocks = [b for p in [README, *pages()] for b in docs_pages.fenced(p.read_text(encoding="utf-8"), "python")
              if b.startswith(f"# {name}.py:")]
    assert len(blocks) == 1, f"expected one python block starting '# {name}.py:' in the docs, found {len(blocks)}"
    return blocks[0]


def test_the_shown_commands_include_the_tour():
    shown = [where for where, _, _ in shown_commands()]
    assert len(shown) >= 30, shown
    readme = [where for where in shown if where.startswith("README.md")]
    for words in (["local"], ["ssh"], ["slurm", "submit"], ["k8s", "manifest"], ["data", "criteo-synthetic"]):
        assert any(f"psworker {' '.join(words)} " in where for where in readme), words


@pytest.mark.parametrize("where, env, argv", shown_commands(), ids=lambda v: v if isinstance(v, str) else "")
def test_every_shown_command_parses(where, env, argv, tmp_path, monkeypatch):
    """As `psworker` parses its command line (`cli._parse`: the flags, then the words after `--` for the commands that
    take one), with the models the command's PSWORKER_MODELS names registered from the docs' own module."""
    modules = [m for m in env.get(registry.PLUGINS_ENV, "").split(",") if m]
    for module in modules:
        (tmp_path / f"{module}.py").write_text(plugin_module(module))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv(registry.PLUGINS_ENV, ",".join(modules))
    err = io.StringIO()
    with registry.scoped(), contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            cli._parse(argv)
        except SystemExit as exc:
            pytest.fail(f"{where}: exit {exc.code}: {err.getvalue().strip()}")
    assert "is old spelling" not in err.getvalue(), f"{where}: {err.getvalue().strip()}"


def test_the_layout_page_names_every_module_and_room_of_psworker():
    """docs/layout.md names each top-level module and package of psworker/ and each room of launcher/ (a module
    added or moved without a word there fails)."""
    text = (DOCS / "layout.md").read_text()
    package = REPO / "psworker"
    names = [f"{p.name}" for p in package.glob("*.py") if p.name not in ("__init__.py", "__main__.py")]
    names += [f"psworker/{p.name}/" for p in package.iterdir() if (p / "__init__.py").exists()]
    names += [f"{p.name}/" for p in (package / "launcher").iterdir() if (p / "__init__.py").exists()]
    missing = [name for name in names if name not in text]
    assert not missing, missing
