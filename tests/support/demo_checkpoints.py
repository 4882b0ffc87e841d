"""A demo architecture's checkpoint as its config.json and a model.safetensors whose header is real and whose data
is a hole (a sparse file): what `strata inspect` and `strata plan` read, at a release's full size, in no disk space."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

from strata.runtime.demo.weights import write_safetensors_header


def header_only_checkpoint(directory: Path, cfg: dict, tensors: Sequence) -> Path:
    """config.json (`cfg`) and model.safetensors with `tensors`' header (each with name, shape, dtype, nbytes) into
    `directory` (made); returns it."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(cfg))
    fd = os.open(directory / "model.safetensors", os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        write_safetensors_header(fd, tensors)  # the data stays a hole
    finally:
        os.close(fd)
    return directory
