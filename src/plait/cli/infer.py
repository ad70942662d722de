"""`plait infer`: apply a trained run to inputs, in batches, over parallel workers.

Example: `plait infer --from runs/gpt --data val --workers 2 --out predictions.jsonl` loads
the checkpoint `plait train --out runs/gpt` wrote (plain or sharded), shards the inputs over
the workers, and writes one JSON line per input, in input order: class and probability for
a classifier, the argmax next token at every position (and the sequence's loss) for a
language model. `--quantize int8` and `--precision bf16` make the model smaller; `--pp` and
`--tp` run each forward through pipeline stages or tensor-parallel layers. See
docs/inference.md.
"""

from __future__ import annotations

import argparse
import json
import sys

from plait.errors import EXIT_BAD_INPUT, CheckpointError, ConfigError, MissingExtraError
from plait.infer.config import InferConfig
from plait.options import add_options, from_args

EXIT_FAILED = 1


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register `plait infer` on the sub-command parser `sub`."""
    p = sub.add_parser(
        "infer",
        help="apply a trained run to inputs: batch prediction over parallel workers",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_options(p, InferConfig)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Predict, print the summary (and write --json); 0, 2 on bad input, 1 if workers died."""
    try:
        # checked before the job's modules import torch: a bad option is answered at once
        config = from_args(InferConfig, args)
        return _predict(config)
    except (ConfigError, CheckpointError, MissingExtraError) as e:
        print(f"plait infer: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT


def _predict(config: InferConfig) -> int:
    from plait.infer.job import InferError
    from plait.infer.job import run as infer

    try:
        result = infer(config, stream=sys.stderr)
    except InferError as e:
        print(f"plait infer: error: {e}", file=sys.stderr)
        return EXIT_FAILED
    for line in summary(result.figures()):
        print(line)
    if config.json is not None:
        with open(config.json, "w") as f:
            json.dump(result.figures(), f, indent=1)
    return 0


def summary(fig: dict[str, object]) -> list[str]:
    """The summary lines of a finished job's figures (InferResult.figures())."""
    how = "int8" if fig["quantize"] == "int8" else str(fig["precision"])
    lines = [
        f"plait infer: wrote {fig['examples']:,} predictions to {fig['out']}",
        f"  model                {fig['model']} ({fig['parameters']:,} parameters, "
        f"{fig['model_bytes']:,} bytes, {how})",
        f"  workers              {fig['workers']}",
        f"  examples/s           {fig['examples_per_s']:,.0f} (while predicting; wall time "
        f"{fig['wall_s']:.1f} s with start-up)",
        f"  latency per batch    p50 {fig['latency_p50_ms']:.2f} ms, p99 "
        f"{fig['latency_p99_ms']:.2f} ms ({fig['batches']} batches)",
    ]
    if fig["metric"] is not None:
        percent = "accuracy" in str(fig["metric_name"])

        def shown(value: object) -> str:
            v = float(str(value))
            return f"{100 * v:.2f}%" if percent else f"{v:.4f}"

        line = f"  {fig['metric_name']!s:<20} {shown(fig['metric'])}"
        if fig["run_metric"] is not None:  # int8's or bf16's cost shows beside it
            line += f" (the run measured {shown(fig['run_metric'])} at its end, in fp32)"
        lines.append(line)
    if fig["retried"]:
        lines.append(f"  retried shards       {fig['retried']}")
    return lines
