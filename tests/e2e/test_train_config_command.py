"""`plait train`'s command line: bad input is a message and exit status 2, not a traceback;
--help lists the defaults."""

from __future__ import annotations

import subprocess
import sys

import pytest


def plait_train(*args: str, prelude: str = "") -> subprocess.CompletedProcess[str]:
    run = f"from plait.cli.main import main\nraise SystemExit(main(['train', *{list(args)!r}]))"
    code = f"{prelude}\n{run}"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)


HIDE_SKLEARN = """
import importlib.util
_real = importlib.util.find_spec
importlib.util.find_spec = lambda name, *a: None if name == "sklearn" else _real(name, *a)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("args", "prelude", "expect"),
    [
        (("--batch-size", "30"), "", "--batch-size 30 % --workers 4 = 2 != 0"),
        (("--model", "resnet"), "", "invalid choice: 'resnet'"),
        (("--data", "mnist"), "", "invalid choice: 'mnist'"),
        (("--model", "gpt", "--data", "digits"), "", "use --data code or synthetic"),
        (("--steps", "many"), "", "invalid int value: 'many'"),
        ((), HIDE_SKLEARN, "pip install 'plait[digits]'"),
        (("--out", "/proc/plait-cannot-write"), "", "cannot write checkpoints to"),
        (("--resume",), "", "--resume needs --out DIR"),
        (("--json", "/nonexistent-dir/f.json"), "", "cannot write --json"),
    ],
    ids=["batch", "model", "data", "mismatch", "int", "extra", "out", "resume", "json"],
)
def test_cli_bad_input_is_a_message_not_a_traceback(
    args: tuple[str, ...], prelude: str, expect: str
) -> None:
    res = plait_train(*args, prelude=prelude)
    assert res.returncode == 2, res.stdout + res.stderr
    assert expect in res.stderr
    assert "Traceback" not in res.stderr + res.stdout
    assert "plait train" in res.stderr


def test_help_lists_defaults() -> None:
    res = subprocess.run(
        [sys.executable, "-m", "plait", "train", "--help"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert res.returncode == 0
    for flag in ("--model", "--data", "--workers", "--steps", "--batch-size", "--lr",
                 "--seed", "--strategy", "--lr-scaling", "--warmup-steps", "--out",
                 "--resume", "--json"):  # fmt: skip
        assert flag in res.stdout
