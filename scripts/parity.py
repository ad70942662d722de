"""Fixed-seed loss sequences of every strategy, recorded before a refactor and checked after.

A change that should not change results (a refactor, a move) must leave every step's loss
identical, to the last digit printed (torchtitan's rule). This runs a few steps of
`plait train` for each strategy and the Horovod example, and compares every loss with the
record in scripts/parity.json.

    .venv/bin/python scripts/parity.py            # run every case, compare with the record
    .venv/bin/python scripts/parity.py --write    # run every case, (re)write the record
    .venv/bin/python scripts/parity.py -k gpt     # only the cases whose name contains "gpt"

Losses are printed with repr(): the float64 of the reduced float32 loss, all 17 digits, so
"identical" means bit-identical. The Horovod example prints 6 decimals itself; those are
compared as printed. Exit status: 0 when every case matches, 1 otherwise.

Bit-identical holds on one kind of CPU only: torch's kernels and MKL's matrix products take
other paths (other summation orders) on AVX-512 than on AVX2, so the record keeps one set of
losses per CPU kind (torch.backends.cpu.get_cpu_capability(): "AVX2", "AVX512", ...). A
kind with no record yet is recorded with --write at a commit known to be good (before the
refactor being checked), never after it. A change that alters some cases' results on
purpose rewrites them on the kinds of CPU at hand and deletes them from the others' record
(they then report "no losses recorded" until an AVX2 or other machine rewrites them).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RECORD = ROOT / "scripts" / "parity.json"
DEADLINE_S = 300  # per case; a hang fails the case instead of the whole run

# name -> plait train options (a few steps each; the seed is the default, 0). ps runs 2
# workers: the servers sum a sync round's gradients in arrival order, and a + b == b + a
# exactly, where (a + b) + c may differ from (a + c) + b in the last bit.
TRAIN_CASES: dict[str, list[str]] = {
    "allreduce-mlp": ["--model", "mlp", "--steps", "8", "--workers", "4"],
    "allreduce-cnn": ["--model", "cnn", "--steps", "6", "--workers", "4"],
    "allreduce-gpt": ["--model", "gpt", "--steps", "6", "--workers", "4"],
    "allreduce-wide": ["--model", "wide", "--steps", "4", "--workers", "2"],
    "ps-sync-mlp": ["--model", "mlp", "--steps", "8", "--workers", "2", "--strategy", "ps",
                    "--servers", "2"],
    "mesh-dp2-pp2-gpt": ["--model", "gpt", "--steps", "4", "--workers", "4", "--pp", "2"],
    "mesh-pp2-tp2-gpt": ["--model", "gpt", "--steps", "4", "--workers", "4", "--pp", "2",
                         "--tp", "2", "--schedule", "gpipe"],
    "mesh-dp2-tp2-gpt": ["--model", "gpt", "--steps", "4", "--workers", "4", "--tp", "2"],
}  # fmt: skip
HOROVOD_CASE = "horovod-example"
HOROVOD_ARGS = ["--epochs", "1", "--train-size", "512", "--test-size", "128",
                "--log-interval", "1"]  # fmt: skip
HOROVOD_LOSS = re.compile(r"Loss: (\S+)")


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONHASHSEED="0")
    env.pop("PLAIT_TRAIN_EVENTS", None)
    return env


def run_train(options: list[str]) -> list[str]:
    """Every step's loss of `plait train OPTIONS`, as repr() strings."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run.json"
        cmd = [sys.executable, "-m", "plait", "train", *options, "--json", str(out)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=DEADLINE_S,
                              env=_env(), cwd=ROOT)  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} exited {done.returncode}:\n{done.stderr[-3000:]}")
        return [repr(float(v)) for v in json.loads(out.read_text())["losses"]]


def run_horovod() -> list[str]:
    """The Horovod example's printed losses on 2 ranks, as printed."""
    script = ROOT / "examples" / "horovod_mnist_style.py"
    cmd = [sys.executable, "-m", "plait", "run", "-n", "2", str(script), *HOROVOD_ARGS]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=DEADLINE_S,
                          env=_env(), cwd=ROOT)  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {done.returncode}:\n{done.stderr[-3000:]}")
    return HOROVOD_LOSS.findall(done.stdout)


def run_case(name: str) -> list[str]:
    return run_horovod() if name == HOROVOD_CASE else run_train(TRAIN_CASES[name])


def cpu_kind() -> str:
    """The kernels this machine's torch runs: "AVX2", "AVX512", "DEFAULT", ..."""
    import torch

    return str(torch.backends.cpu.get_cpu_capability())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="record instead of comparing")
    parser.add_argument("-k", default="", help="only cases whose name contains this")
    args = parser.parse_args()
    names = [n for n in [*TRAIN_CASES, HOROVOD_CASE] if args.k in n]
    records = json.loads(RECORD.read_text()) if RECORD.exists() else {}
    kind = cpu_kind()
    record = records.setdefault(kind, {})
    if not record and not args.write:
        print(f"no losses recorded for this CPU kind ({kind}; recorded: {sorted(records)}): "
              "record them with --write at a commit known to be good")  # fmt: skip
        return 1
    print(f"comparing with the losses recorded on {kind}", flush=True)
    failed = []
    for name in names:
        began = time.perf_counter()
        try:
            losses = run_case(name)
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            print(f"{name}: FAILED to run: {e}", flush=True)
            failed.append(name)
            continue
        took = f"{time.perf_counter() - began:.0f} s"
        if args.write:
            record[name] = losses
            print(f"{name}: recorded {len(losses)} losses ({took})", flush=True)
            continue
        want = record.get(name)
        if want is None:  # e.g. a change to its results recorded on another kind of CPU
            failed.append(name)
            print(f"{name}: no losses recorded on {kind} for it: record them with --write "
                  f"-k {name} at a commit known to be good ({took})", flush=True)  # fmt: skip
            continue
        if want == losses:
            print(f"{name}: identical, {len(losses)} losses ({took})", flush=True)
            continue
        failed.append(name)
        print(f"{name}: DIFFERENT ({took})", flush=True)
        for i, (a, b) in enumerate(zip(want or [], losses, strict=False)):
            if a != b:
                print(f"  first difference at loss {i + 1}: recorded {a}, now {b}")
                break
        else:
            print(f"  recorded {len(want or [])} losses, now {len(losses)}")
    if args.write:
        RECORD.write_text(json.dumps(records, indent=1) + "\n")
        print(f"wrote {RECORD.relative_to(ROOT)} ({kind})")
    print(f"{len(names) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
