"""Horovod's timeline with no events is valid JSON (the recorded timelines are in
tests/world/test_horovod_timeline.py)."""

from __future__ import annotations

import json


def test_an_empty_timeline_is_valid_json() -> None:
    from plait.horovod.torch.timeline_format import render

    events = json.loads(render([], 7))
    assert events[0]["args"] == {"start_time_since_epoch_in_micros": 7} and len(events) == 2
