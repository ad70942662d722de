"""`plait infer`'s loading in this process, no worker started: a language model trained from a
Workload object reads a file as bytes, and a directory without a run is named."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from plait.errors import CheckpointError, ConfigError
from plait.infer import load_run, predict
from plait.train import checkpoint, models
from plait.train.data.base import LanguageModelling
from plait.train.gpt import GPTConfig
from plait.train.workload import TOKEN_LOSS, Workload, cross_entropy

SMALL = GPTConfig(n_layer=1, n_head=2, n_embd=16)


def _byte_model_run(where: Path) -> Workload:
    """A run directory holding an untrained byte-level gpt, and its Workload (a Python
    object: the run can only be loaded with it)."""
    tokens = torch.randint(0, 256, (1000,), dtype=torch.uint8)
    data = LanguageModelling("bytes", tokens, tokens, vocab_size=256, block_size=64)
    work = Workload(name="byte-gpt", model=partial(models.gpt, 256, 64, SMALL), data=data,
                    loss=cross_entropy, metric=TOKEN_LOSS)  # fmt: skip
    state = {"model": work.build_model(0).state_dict(), "options": {"given": True, "seed": 0},
             "step": 0, "evals": []}  # fmt: skip
    where.mkdir()
    checkpoint.save(where, state)
    return work


def test_a_language_model_reads_a_file_as_bytes(tmp_path: Path) -> None:
    work = _byte_model_run(tmp_path / "run")
    with pytest.raises(CheckpointError, match="trained a Workload object passed from Python"):
        load_run(tmp_path / "run")
    text = bytes(range(200)) * 2
    (tmp_path / "text.txt").write_bytes(text)
    result = predict(tmp_path / "run", out=tmp_path / "c.jsonl", data=str(tmp_path / "text.txt"),
                     workload=work)  # fmt: skip
    assert result.examples == (400 - 1) // 64 and result.metric is not None
    rows = [json.loads(r) for r in (tmp_path / "c.jsonl").read_text().splitlines()]
    model = work.build_model(0).eval()
    window = torch.tensor(list(text[64:129])).long()  # the second window and its next bytes
    logits = model(window[None, :64])
    assert rows[1]["next"] == logits.argmax(-1)[0].tolist()
    assert rows[1]["loss"] == pytest.approx(F.cross_entropy(logits[0], window[1:]).item(), abs=1e-5)
    with pytest.raises(ConfigError, match="workers > 1 rebuild the run from its options"):
        predict(tmp_path / "run", out=tmp_path / "d.jsonl", workload=work, workers=2)


def test_no_run_there(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"holds neither checkpoint\.pt nor checkpoint\.json"):
        predict(tmp_path, out=tmp_path / "p.jsonl")
