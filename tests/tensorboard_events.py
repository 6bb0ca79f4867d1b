"""TensorBoard event files read back without the tensorboard package (tests of the loggers)."""

from __future__ import annotations

import struct
from collections import defaultdict
from pathlib import Path


def read_scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    """TensorBoard event files (TFRecords of Event protos) read back: tag -> [(step, value)]."""
    from tensorboardX.proto import event_pb2

    scalars: dict[str, list[tuple[int, float]]] = defaultdict(list)
    files = sorted(logdir.rglob("events.out.tfevents.*"))
    assert files, f"no event files under {logdir}"
    for path in files:
        data, i = path.read_bytes(), 0
        while i < len(data):
            (length,) = struct.unpack("<Q", data[i : i + 8])
            event = event_pb2.Event()
            event.ParseFromString(data[i + 12 : i + 12 + length])
            i += 12 + length + 4  # length, its crc, the record, its crc
            for value in event.summary.value:
                scalars[value.tag].append((event.step, value.simple_value))
    return scalars
