"""The host discovery script (launch/discovery.py): its lines, this machine's names, and a
run of a real script (one shell each)."""

from __future__ import annotations

import re
import socket
from pathlib import Path

import pytest

from plait.launch.discovery import Discovery, Failed, Found, is_this_machine, parse


def test_lines_give_hosts_and_slots_in_order() -> None:
    text = "b:2\n\n  a:4  \nc\n[::1]:1\nd:0\nb:2\n"
    assert parse(text, slots_per_host=3) == {"b": 2, "a": 4, "c": 3, "::1": 1, "d": 0}
    assert parse("", None) == {}  # no host ready yet


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("a:2\nb\n", "line 2 'b' gives no slots: print `b:N`, or pass --slots-per-host N"),
        ("a:x\n", "line 1 'a:x': slots must be a whole number >= 0, got 'x'"),
        ("a:-1\n", "slots must be a whole number >= 0, got '-1'"),
        ("a:1\na:2\n", "line 2 'a:2': host 'a' was listed with 1 slot(s)"),
        ("host one:2\n", "line 1 'host one:2' is not `host:slots` or `host`"),
    ],
)
def test_a_bad_line_is_refused_with_the_line(text: str, says: str) -> None:
    with pytest.raises(ValueError, match=re.escape(says)):
        parse(text, None)


@pytest.mark.parametrize(
    ("host", "here"),
    [
        ("localhost", True),
        ("127.0.0.1", True),
        ("127.0.0.2", True),  # Linux answers the whole loopback range
        (socket.gethostname(), True),
        ("192.0.2.1", False),  # TEST-NET-1: nobody's
        ("0.0.0.0", False),
    ],
)
def test_names_of_this_machine(host: str, here: bool) -> None:
    assert is_this_machine(host) is here


def script(tmp_path: Path, body: str) -> str:
    path = tmp_path / "discover.sh"
    path.write_text(body)
    return f"sh {path}"


def test_a_run_reads_local_hosts_and_sets_others_apart(tmp_path: Path) -> None:
    run = Discovery(script(tmp_path, "echo localhost:2\necho 192.0.2.1:4\necho 127.0.0.1\n"), 1)
    assert run.run_once() == Found({"localhost": 2, "127.0.0.1": 1}, ("192.0.2.1",))


@pytest.mark.parametrize(
    ("body", "why"),
    [
        ("echo 'no hosts file' >&2\nexit 3\n", "ended with exit code 3: no hosts file"),
        ("echo localhost:2\necho oops:\n", "printed a bad line: line 2 'oops:': slots must"),
    ],
)
def test_a_failed_run_says_why_and_gives_no_hosts(tmp_path: Path, body: str, why: str) -> None:
    got = Discovery(script(tmp_path, body), None).run_once()
    assert isinstance(got, Failed) and got.why.startswith(why), got
