"""Drafter files written so that a failed save leaves the folder as it was, and read with errors that name the file.

A save (weights, config, optimizer state, trainer state) first writes every file under a temporary name in the
target folder; only when all of them are written are they renamed into place. A full disk, a quota or an interrupt
during the writes therefore leaves the previous drafter (or checkpoint) whole: the error says so, and the
temporary files are removed.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file


class StagedFiles:
    """The files of one save: :meth:`path` gives where to write ``name``; they are renamed into place together."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.files: list[tuple[Path, Path]] = []

    def path(self, name: str) -> Path:
        staged = self.directory / f".{name}.tmp-{os.getpid()}"
        self.files.append((staged, self.directory / name))
        return staged


@contextmanager
def staged_save(directory: str | os.PathLike) -> Iterator[StagedFiles]:
    """Write a drafter's files under temporary names, then rename them all into ``directory`` (module doc)."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    staged = StagedFiles(path)
    try:
        yield staged
    except BaseException as err:
        for temporary, _ in staged.files:
            temporary.unlink(missing_ok=True)
        if isinstance(err, Exception):
            err.add_note(f"Nothing in {path} was replaced: the drafter saved there before (if any) is intact.")
        raise
    for temporary, final in staged.files:
        os.replace(temporary, final)


def load_weights(path: Path) -> dict[str, torch.Tensor]:
    """A drafter's safetensors file, or a ValueError naming it and what to do when it is truncated or corrupt."""
    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as err:
        if isinstance(err, FileNotFoundError):
            raise
        raise ValueError(
            f"The drafter weights at {path} are truncated or corrupt ({err}). Re-download or re-save the drafter, "
            "resume from an earlier checkpoint, or delete the folder to start from a fresh drafter."
        ) from err
