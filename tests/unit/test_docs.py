"""The README and docs/ pages: every `plait ...` command shown parses, every relative link
resolves, and the generated environment page is current.

Commands come from fenced code blocks (not Python ones) and from inline code spans. A
command written out in full (`plait train --model cnn`) is parsed as the shell would pass
it, by the real parser: its options, their values and choices. A synopsis (`[--json F]`,
`--dp/--pp/--tp`, `FILE`) only has its subcommand path and option names checked. Every
distinct subcommand path is also run with `--help`. Nothing is executed; it all takes well
under a second.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import re
import shlex
from collections.abc import Iterator
from pathlib import Path

import pytest

from plait import env
from plait.cli.main import build_parser
from support.paths import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 200  # the README is a front door; the rest lives in docs/

FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})(.*)$")
NOT_SHELL = {"python", "py", "json", "toml", "yaml", "text"}


def blocks(text: str) -> tuple[list[str], str]:
    """(the shell-like fenced blocks' lines, the text outside every fenced block)."""
    shell: list[str] = []
    prose: list[str] = []
    fence = ""
    keep = False
    for line in text.splitlines():
        m = FENCE.match(line)
        if not fence and m:
            fence, keep = m.group(2), m.group(3).strip().lower() not in NOT_SHELL
        elif fence and line.strip().startswith(fence):
            fence = ""
        elif fence:
            if keep:
                shell.append(line)
        else:
            prose.append(line)
    return shell, "\n".join(prose)


def spans(prose: str) -> list[str]:
    """The inline code spans of `prose` (one or more backticks, possibly across a line)."""
    return [m.group(2) for m in re.finditer(r"(`+)(.+?)\1", prose, re.S)]


def strip_spans(prose: str) -> str:
    return re.sub(r"(`+)(.+?)\1", "", prose, flags=re.S)


def shell_lines(lines: list[str]) -> list[str]:
    """Logical lines: backslash continuations and indented `[--option]` lines joined to the
    line before, `$ ` prompts dropped."""
    out: list[str] = []
    joined = False  # the last line ended with a backslash
    for line in lines:
        text = line.strip()
        text = text[2:] if text.startswith("$ ") else text
        if out and (joined or (line[:1].isspace() and text.startswith("["))):
            out[-1] += " " + text
        else:
            out.append(text)
        joined = out[-1].endswith("\\")
        if joined:
            out[-1] = out[-1][:-1].rstrip()
    return out


def commands_in(line: str) -> Iterator[list[str]]:
    """The plait command lines in one shell line, as argv lists (without `plait`)."""
    for part in re.split(r"\s(?:&&|\|\||\|)\s|;\s|\s&$", line):
        part = re.sub(r"(^|\s)#.*$", "", part).strip()
        try:
            words = shlex.split(part)
        except ValueError:
            continue
        for i, w in enumerate(words):
            starts = w == "plait" or w.endswith("/plait")
            via_m = w == "plait" and i > 0 and words[i - 1] == "-m"
            if starts and (
                i == 0 or via_m or words[i - 1] in ("env", "exec") or "=" in words[i - 1]
            ):
                rest = words[i + 1 :]
                if rest and re.fullmatch(r"[a-z][a-z0-9-]*", rest[0]):
                    yield rest
                break


def shown_commands() -> list[tuple[str, list[str], bool]]:
    """Every (page, argv, in prose) shown in README.md and docs/*.md."""
    found = []
    for page in PAGES:
        shell, prose = blocks(page.read_text())
        for line in shell_lines(shell):
            found += [(page.name, argv, False) for argv in commands_in(line)]
        for span in spans(prose):
            found += [(page.name, argv, True) for argv in commands_in(" ".join(span.split()))]
    return found


@functools.cache
def plait_parser() -> argparse.ArgumentParser:
    """The real `plait` parser, built once (parsing does not change it)."""
    return build_parser()


def subparsers(p: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def resolve(argv: list[str]) -> tuple[list[str], argparse.ArgumentParser, list[str]]:
    """(subcommand path, its parser, the words after it); fails on an unknown subcommand."""
    parser, path, rest = plait_parser(), [], list(argv)
    while rest and (subs := subparsers(parser)):
        if rest[0] not in subs:
            raise AssertionError(
                f"unknown subcommand {rest[0]!r} after {path}; known: {sorted(subs)}"
            )
        parser = subs[rest[0]]
        path.append(rest.pop(0))
    return path, parser, rest


def is_synopsis(words: list[str]) -> bool:
    """A usage line rather than a command: brackets, ellipses, alternatives, placeholders."""
    return any(
        re.search(r"[\[\]<>|]|\.\.\.", w)
        or (w.startswith("--") and "/" in w)
        or re.fullmatch(r"[A-Z][A-Z0-9_]*", w)
        for w in words
    )


# what a command quoted in prose may leave out: a required argument, an option's value
FRAGMENT_ERRORS = ("the following arguments are required", "expected one argument")


def check(argv: list[str], fragment: bool = False) -> None:
    """Parse `plait argv` as the page shows it; raise AssertionError saying what is wrong.

    A `fragment` (a command quoted in prose, such as `plait run --servers`) may leave out
    a required argument or an option's value; its subcommands and options must exist.
    """
    path, parser, rest = resolve(argv)
    words = [re.sub(r"^\$\{?\w+\}?$", "0", w) for w in rest]  # $NODE: a shell variable
    if not words:
        return
    if not is_synopsis(words):
        err = io.StringIO()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            try:
                args = plait_parser().parse_args(path + words)
                if path == ["run"] and args.script is None and not fragment:
                    raise AssertionError("plait run needs the program to run (SCRIPT)")
            except SystemExit as e:
                message = err.getvalue().strip()
                if e.code != 0 and not (fragment and any(f in message for f in FRAGMENT_ERRORS)):
                    raise AssertionError(message or f"exit {e.code}") from None
        for i, w in enumerate(words[:-1]):  # plait run ... -m plait train ...
            if path == ["run"] and w in ("-m", "--module") and words[i + 1] == "plait":
                check(words[i + 2 :], fragment)
                break
    takes_value = {
        s: a.nargs != 0 for a in parser._actions for s in a.option_strings
    }  # store_true and --help take none
    skip = False
    for w in words:
        w = w.strip("[]")
        if skip or not w.startswith("-"):
            if not skip and not is_synopsis([w]) and path == ["run"]:
                break  # the script: what follows is its own
            skip = False
            continue
        for name in w.split("/"):
            name = name.split("=")[0]
            if name not in takes_value:
                raise AssertionError(f"plait {' '.join(path)} has no option {name}")
            skip = takes_value[name] and "=" not in w


COMMANDS = shown_commands()


def test_pages_show_commands() -> None:
    # the extraction itself: the Quickstart's command and a continued multi-host line
    argvs = [argv for _, argv, _ in COMMANDS]
    assert ["train"] in argvs
    assert any(argv[:2] == ["run", "-n"] and "--nnodes" in argv for argv in argvs)
    assert len(COMMANDS) > 50


@pytest.mark.parametrize(
    "page, argv, fragment", COMMANDS, ids=[f"{p}: plait {' '.join(a)}" for p, a, _ in COMMANDS]
)
def test_command_parses(page: str, argv: list[str], fragment: bool) -> None:
    check(argv, fragment)


def shown_paths() -> list[tuple[str, ...]]:
    """Every distinct subcommand path shown (an unknown one fails test_command_parses)."""
    paths = set()
    for _, argv, _ in COMMANDS:
        with contextlib.suppress(AssertionError):
            paths.add(tuple(resolve(argv)[0]))
    return sorted(paths)


@pytest.mark.parametrize("path", shown_paths(), ids=" ".join)
def test_help(path: tuple[str, ...]) -> None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as e:
        build_parser().parse_args([*path, "--help"])
    assert e.value.code == 0
    assert "usage: plait" in out.getvalue()


@pytest.mark.parametrize(
    "line",
    [
        "plait trian",  # unknown subcommand
        "plait train --modle cnn",  # unknown option
        "plait train --schedule zigzag",  # bad choice
        "plait run -n 4",  # no script (a full command, not a fragment in prose)
        "plait bench collectives [--sizes 4K] [--no-such]",  # a synopsis's option
        "plait train --dp/--pp/--tpp",  # one of several alternatives
        "PLAIT_SERVERS=2 torchrun -m plait train --no-such",  # after -m plait
        "plait run -n 2 -m plait train --no-such",  # through plait run -m plait
    ],
)
def test_check_catches(line: str) -> None:
    [argv] = list(commands_in(line))
    with pytest.raises(AssertionError):
        check(argv)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    _, prose = blocks(page.read_text())
    seen: dict[str, int] = {}
    found = set()
    for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*\s*$", prose, re.M):
        s = slug(m.group(1))
        n = seen.get(s, 0)
        seen[s] = n + 1
        found.add(s if n == 0 else f"{s}-{n}")
    return found


def links(page: Path) -> list[str]:
    _, prose = blocks(page.read_text())
    return [m.group(1) for m in re.finditer(r"\]\(([^)\s]+)\)", strip_spans(prose))]


def broken(page: Path, target: str) -> str | None:
    """Why `target`, linked from `page`, does not resolve; None when it does."""
    if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
        return None
    path, _, anchor = target.partition("#")
    dest = (page.parent / path).resolve() if path else page
    if not dest.exists():
        return f"{dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest} does not exist"
    if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
        return f"{dest.name} has no heading #{anchor}"
    return None


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_links_resolve(page: Path) -> None:
    bad = [f"({t}): {why}" for t in links(page) if (why := broken(page, t))]
    assert not bad, f"{page.relative_to(ROOT)}: broken links:\n" + "\n".join(bad)


def test_broken_link_is_caught(tmp_path: Path) -> None:
    (tmp_path / "a.md").write_text("# A page\n\n## Two words\n")
    page = tmp_path / "index.md"
    page.write_text("[ok](a.md#two-words) [no file](b.md) [no anchor](a.md#three)\n")
    assert [broken(page, t) for t in links(page)] == [
        None,
        f"{tmp_path / 'b.md'} does not exist",
        "a.md has no heading #three",
    ]


def test_every_page_is_listed() -> None:
    index = ROOT / "docs" / "README.md"
    listed = {(index.parent / t.partition("#")[0]).resolve() for t in links(index)}
    missing = [p.name for p in PAGES[1:] if p != index and p.resolve() not in listed]
    assert not missing, f"docs/README.md does not list {missing}"


def test_environment_page_is_generated() -> None:
    page = ROOT / "docs" / "environment.md"
    assert page.read_text() == env.markdown(), (
        "docs/environment.md is out of date: .venv/bin/python -m plait.env > docs/environment.md"
    )


def test_readme_is_short() -> None:
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines > {README_MAX_LINES}"
