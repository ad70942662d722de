"""scripts/gpu-check.sh without a GPU: it refuses at once, installing and writing nothing;
its dry run lists every step, and every `plait` command in it parses."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from plait.cli.main import build_parser
from support.paths import ROOT

SCRIPT = ROOT / "scripts" / "gpu-check.sh"
BASH = shutil.which("bash") or "/bin/bash"
STEPS = [
    "tests",
    "collectives-cuda",
    "train-cuda",
    "collectives-cpu-8",
    "collectives-cpu-16",
    "many-ranks",
]


def gpu_check(*args: str, path: str, extra: dict[str, str] | None = None):
    env = {k: v for k, v in os.environ.items() if k != "GPU_CHECK_DRY_RUN"}
    env.update(PATH=path, **(extra or {}))
    return subprocess.run(
        [BASH, str(SCRIPT), *args], capture_output=True, text=True, timeout=30, env=env
    )


def tools(tmp_path: Path, *names: str) -> Path:
    """A folder of the named commands (links to this machine's), to make a PATH of."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name in names:
        found = shutil.which(name)
        assert found, name
        (bin_dir / name).symlink_to(found)
    return bin_dir


@pytest.mark.parametrize("gpu_tool", ["missing", "lists none"])
def test_refuses_without_a_gpu_before_anything(tmp_path: Path, gpu_tool: str) -> None:
    bin_dir = tools(tmp_path, "dirname", "grep", "head")
    if gpu_tool == "lists none":  # what nvidia-smi says on a machine whose GPU is gone
        fake = bin_dir / "nvidia-smi"
        fake.write_text("#!/bin/sh\necho 'No devices were found'\nexit 6\n")
        fake.chmod(0o755)
    report = tmp_path / "out" / "report.md"
    start = time.monotonic()
    # PATH holds no python, pip or pytest: a step past the check would fail differently
    proc = gpu_check(str(report), path=str(bin_dir))
    assert time.monotonic() - start < 10
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "gpu-check: no GPU here" in proc.stderr and "nothing was installed" in proc.stderr
    assert proc.stdout == "" and not report.parent.exists()


def dry_run(*args: str) -> list[tuple[str, str]]:
    proc = gpu_check(*args, path=os.environ["PATH"], extra={"GPU_CHECK_DRY_RUN": "1"})
    assert proc.returncode == 0, proc.stderr
    steps = []
    for line in proc.stdout.splitlines():
        assert line.startswith("== "), line
        name, command = line[3:].split(": ", 1)
        steps.append((name, command))
    return steps


def test_the_dry_run_lists_every_step_and_its_commands_parse() -> None:
    steps = dry_run()
    assert [name for name, _ in steps] == STEPS
    for name, command in steps:
        words = shlex.split(command)
        if "plait" in words:  # python -m plait ARGS: parsed by the real parser
            args = words[words.index("plait") + 1 :]
            build_parser().parse_args(args)
            if name.endswith("-cuda"):
                assert args[args.index("--device") + 1] == "cuda"
        else:  # python -m pytest ...: the paths exist
            assert words[words.index("pytest") + 1 :][-1] in (
                "tests",
                "tests/world/test_many_ranks.py",
            )
            assert (ROOT / words[-1]).exists()
    assert "-m cuda" in dict(steps)["tests"]


def test_only_runs_the_steps_named() -> None:
    assert [n for n, _ in dry_run("--only", "tests,many-ranks")] == ["tests", "many-ranks"]
    proc = gpu_check("--only", "bench", path=os.environ["PATH"])
    assert proc.returncode == 2 and "unknown step 'bench'" in proc.stderr
