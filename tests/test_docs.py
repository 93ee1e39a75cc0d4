"""The manual: README.md and the MkDocs site under docs/ (mkdocs.yml).  The
command-line page is what docs/gen_cli.py makes of flor/cli.py, relative
links point at files that exist, the README keeps its quick start and its
size, and every page is in the site's nav.  `make docs` builds the site."""
import glob
import importlib.util
import os
import re

import pytest

from conftest import ROOT

DOCS = os.path.join(ROOT, "docs")
README = os.path.join(ROOT, "README.md")


def _read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def _pages():
    return sorted(glob.glob(os.path.join(DOCS, "*.md")))


def _gen_cli():
    spec = importlib.util.spec_from_file_location("gen_cli", os.path.join(DOCS, "gen_cli.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.unit
def test_the_command_line_page_is_what_the_parser_prints():
    page = _read(os.path.join(DOCS, "command-line.md"))
    assert page == _gen_cli().generate(), \
        "docs/command-line.md is out of date: run python docs/gen_cli.py"


@pytest.mark.unit
def test_the_command_line_page_has_every_command():
    text = _gen_cli().generate()
    for command in ("record", "replay", "merge", "runs", "show", "rm", "prune", "plot",
                    "export"):
        assert f"## `python -m flor {command}`" in text
        assert f"usage: python -m flor {command} " in text


# -- links -------------------------------------------------------------------

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
CODE = re.compile(r"`[^`\n]*`")


def _links(text):
    """The targets of the Markdown links and images of text, outside code."""
    prose = CODE.sub("", FENCE.sub("", text))
    return LINK.findall(prose)


def _broken(path):
    """The relative links of the Markdown file at path whose file is missing."""
    broken = []
    for target in _links(_read(path)):
        if target.startswith(("http://", "https://", "mailto:", "#")):
            continue
        file = target.split("#", 1)[0]
        if not os.path.exists(os.path.join(os.path.dirname(path), file)):
            broken.append(target)
    return broken


@pytest.mark.unit
def test_relative_links_point_at_files_that_exist():
    found = {os.path.relpath(p, ROOT): _broken(p) for p in [README, *_pages()]}
    assert {p: b for p, b in found.items() if b} == {}
    # the check saw the links there are
    assert "docs/getting-started.md" in _links(_read(README))
    assert "../examples/demo.py" in _links(_read(os.path.join(DOCS, "getting-started.md")))


@pytest.mark.unit
def test_the_link_check_finds_a_missing_file(tmp_path):
    (tmp_path / "here.md").write_text("x")
    page = tmp_path / "page.md"
    page.write_text("[a](here.md) [b](gone.md#part) ![c](img/none.png) [d](#anchor)\n"
                    "[e](https://example.org/x) `[f](in-code.md)`\n"
                    "```\n[g](in-a-block.md)\n```\n")
    assert _broken(str(page)) == ["gone.md#part", "img/none.png"]


# -- the README --------------------------------------------------------------

def _quick_start(text):
    """The commands of the first ```sh block after the Quick start heading."""
    after = text.split("\n## Quick start\n", 1)[1]
    block = after.split("```sh\n", 1)[1].split("\n```", 1)[0]
    commands = [line.split("#", 1)[0].strip() for line in block.splitlines()]
    return [c for c in commands if c]


@pytest.mark.unit
def test_the_readme_quick_start_is_make_demo_and_make_test():
    assert _quick_start(_read(README)) == ["make demo", "make test"]


@pytest.mark.unit
def test_the_quick_start_check_reads_the_first_sh_block_after_its_heading():
    text = ("# X\n\n```sh\nmake other\n```\n\n## Quick start\n\ntext\n\n"
            "```sh\nmake demo   # one\nmake test\nmake more\n```\n\n```sh\nmake later\n```\n")
    assert _quick_start(text) == ["make demo", "make test", "make more"]


@pytest.mark.unit
def test_the_readme_is_short():
    lines = _read(README).count("\n")
    assert lines <= 200, f"README.md has {lines} lines: move the rest into docs/"


# -- the site ----------------------------------------------------------------

def _nav(text):
    """The files that mkdocs.yml's nav lists."""
    files, inside = [], False
    for line in text.splitlines():
        if re.match(r"nav:\s*$", line):
            inside = True
        elif inside and line.strip() and not line.startswith((" ", "-", "#")):
            break
        elif inside and line.strip().startswith("- "):
            item = line.strip()[2:]
            target = item.rsplit(":", 1)[-1].strip() if ":" in item else item.strip()
            if target:  # a section ("- Part:") lists its pages below it
                files.append(target)
    return files


@pytest.mark.unit
def test_every_page_is_in_the_nav():
    nav = _nav(_read(os.path.join(ROOT, "mkdocs.yml")))
    pages = [os.path.basename(p) for p in _pages()]
    assert [p for p in pages if p not in nav] == []
    assert [f for f in nav if f not in pages] == []


@pytest.mark.unit
def test_the_nav_check_reads_the_entries():
    text = ("site_name: X\nnav:\n  - Home: index.md\n  - Part:\n    - a.md\n"
            "    - Two words: b.md\ntheme:\n  name: mkdocs\n")
    assert _nav(text) == ["index.md", "a.md", "b.md"]
