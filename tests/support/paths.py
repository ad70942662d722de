"""Where the repository's parts are, for tests in any of tests/'s directories."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository: tests/support/paths.py
SRC = ROOT / "src"
EXAMPLES = ROOT / "examples"
LAUNCH_SCRIPTS = Path(__file__).resolve().parent / "launch_scripts"  # scripts tests launch
