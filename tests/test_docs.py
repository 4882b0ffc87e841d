"""The documentation stays true to the code.

Every key of the configuration dataclasses is named in its section of docs/configuration.md; every option of every
`strata` command is named on the page that documents the command; every route of the server (with its method) is
named in docs/serving.md; README.md stays a short read; and every relative link of README.md and docs/*.md (and
its #anchor) resolves. Names are read from the code, so a key, option or route added without its documentation
fails here.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

import pytest

from strata.config import StrataConfig

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README_MAX_LINES = 220

# where each command's options are documented
COMMAND_PAGES = {
    "generate": "getting-started.md",
    "demo-model": "getting-started.md",
    "serve": "serving.md",
    "plan": "tiers-and-planner.md",
    "inspect": "tiers-and-planner.md",
    "convert": "tiers-and-planner.md",
    "verify": "tiers-and-planner.md",
}


def config_keys(cls: type = StrataConfig, prefix: str = "") -> dict[str, list[str]]:
    """{section: [keys]} of the configuration dataclasses, e.g. {"tiers.gpu": ["budget"], ...}."""
    sections: dict[str, list[str]] = {}
    for f in dataclasses.fields(cls):
        default = f.default_factory() if callable(f.default_factory) else f.default
        if dataclasses.is_dataclass(default):
            sections.update(config_keys(type(default), f"{prefix}{f.name}."))
        else:
            sections.setdefault(prefix.rstrip("."), []).append(f.name)
    return sections


def markdown_sections(text: str) -> dict[str, str]:
    """{heading text: the text up to the next heading} of a Markdown page (fenced code left as text)."""
    out: dict[str, str] = {}
    heading, body = "", []
    fenced = False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        if not fenced and re.match(r"#{1,6} ", line):
            out[heading] = "\n".join(body)
            heading, body = line.lstrip("#").strip(), []
        else:
            body.append(line)
    out[heading] = "\n".join(body)
    return out


def undocumented_keys(doc: str) -> list[str]:
    """`section.key` of every configuration key not named (in backticks) under its `[section]` heading of `doc`."""
    sections = markdown_sections(doc)
    missing = []
    for section, keys in config_keys().items():
        body = next((b for h, b in sections.items() if f"[{section}]" in h), None)
        missing += [f"{section}.{key}" for key in keys if body is None or f"`{key}`" not in body]
    return missing


def mentions(text: str, name: str) -> bool:
    """Whether `text` names `name` as a whole word (an option, a path), not inside a longer one."""
    return re.search(rf"(?<![\w/.-]){re.escape(name)}(?![\w-])", text) is not None


def subcommands() -> dict[str, argparse.ArgumentParser]:
    from strata.cli import build_parser

    parser = build_parser(only=None)  # every command's arguments, `serve` and `plan` included
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def undocumented_options(parser: argparse.ArgumentParser, doc: str) -> list[str]:
    """The long options of `parser` (and the choices they take) that `doc` does not name."""
    missing = []
    for action in parser._actions:
        longs = [o for o in action.option_strings if o.startswith("--") and o != "--help"]
        missing += [o for o in longs if not mentions(doc, o)]
        if longs and action.choices:
            missing += [f"{longs[0]} {c}" for c in action.choices if f"`{c}`" not in doc]
    return missing


def server_routes() -> list[tuple[str, str]]:
    """(method, path) of every route of the server app; a path parameter is cut off (`/dashboard/static/`)."""
    from strata.server.app import create_app

    app = create_app(None, None, "docs")
    routes = []
    for route in app.routes:
        path = route.path.split("{")[0]
        routes += [(method, path) for method in sorted(route.methods or ()) if method != "HEAD"]
    return routes


def undocumented_routes(doc: str) -> list[str]:
    """`METHOD path` of every route `doc` does not name: with its method where the path is whole, else the path."""
    missing = []
    for method, path in server_routes():
        whole = not path.endswith("/")
        if (whole and not mentions(doc, f"{method} {path}")) or not mentions(doc, path):
            missing.append(f"{method} {path}")
    return missing


def github_slug(heading: str) -> str:
    """The #anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The heading anchors of a Markdown page (repeated headings get -1, -2, ... as on GitHub)."""
    seen: dict[str, int] = {}
    out = set()
    for heading in markdown_sections(page.read_text()):
        if not heading:
            continue
        slug = github_slug(heading)
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def broken_links(page: Path) -> list[str]:
    """The relative links of `page` (outside code blocks) whose file, or #anchor in a Markdown file, is missing."""
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    broken = []
    for target in re.findall(r"\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^)\s]+)\)", text):  # link text may hold [x]
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(target)
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(target)
    return broken


def doc_pages() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


# ---- the tests ----------------------------------------------------------------------------------------------


def test_every_config_key_is_documented_in_its_section():
    missing = undocumented_keys((DOCS / "configuration.md").read_text())
    assert not missing, f"docs/configuration.md does not document: {', '.join(missing)}"


def test_an_undocumented_config_key_is_caught():
    doc = (DOCS / "configuration.md").read_text()
    without = doc.replace("| `lfu_half_life` |", "| lfu half-life |")
    assert without != doc
    assert undocumented_keys(without) == ["policy.lfu_half_life"]


@pytest.mark.parametrize("command", sorted(COMMAND_PAGES))
def test_every_command_option_is_documented(command):
    page = COMMAND_PAGES[command]
    missing = undocumented_options(subcommands()[command], (DOCS / page).read_text())
    assert not missing, f"docs/{page} does not document `strata {command}` {', '.join(missing)}"


def test_every_command_is_documented():
    commands = subcommands()
    assert set(commands) == set(COMMAND_PAGES), "a command was added or removed: map it to its page in COMMAND_PAGES"
    table = (DOCS / "getting-started.md").read_text()
    assert not [c for c in commands if f"`strata {c}" not in table]


def test_an_undocumented_option_is_caught():
    doc = (DOCS / "serving.md").read_text()
    assert undocumented_options(subcommands()["serve"], doc.replace("--max-tokens-default", "--max-tokens-dflt")) \
        == ["--max-tokens-default"]


def test_every_route_is_documented():
    missing = undocumented_routes((DOCS / "serving.md").read_text())
    assert not missing, f"docs/serving.md does not document: {', '.join(missing)}"


def test_an_undocumented_route_is_caught():
    doc = (DOCS / "serving.md").read_text()
    assert ("POST", "/detokenize") in server_routes()
    assert undocumented_routes(doc.replace("POST /detokenize", "POST /de-tokenize")) == ["POST /detokenize"]


def test_readme_is_short():
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; keep it under {README_MAX_LINES} (details go in docs/)"


def test_every_docs_page_is_linked_from_the_readme():
    readme = (ROOT / "README.md").read_text()
    assert not [p.name for p in DOCS.glob("*.md") if f"(docs/{p.name})" not in readme]


@pytest.mark.parametrize("page", doc_pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    assert not broken_links(page), f"{page.relative_to(ROOT)}: broken links {broken_links(page)}"


def test_a_broken_link_is_caught(tmp_path):
    (tmp_path / "other.md").write_text("# Title\n\n## A section: with `code`\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](other.md#a-section-with-code) [no file](gone.md) [`[x]`](other.md#nowhere) "
                    "[web](https://example.com/x)\n```\n[in code](ignored.md)\n```\n")
    assert broken_links(page) == ["gone.md", "other.md#nowhere"]
