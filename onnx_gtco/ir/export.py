"""Validate a rewritten model and save it atomically (temp files, then rename), external data past 2 GB."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import onnx

from onnx_gtco.errors import OutputError, RewriteError

PROTOBUF_LIMIT = 2**31 - 1


def validate(model: onnx.ModelProto) -> None:
    """Full ONNX check (strict shape inference through the local functions)."""
    try:
        if model.ByteSize() < PROTOBUF_LIMIT:
            onnx.checker.check_model(model, full_check=True)
        else:  # the checker cannot take >2 GB in memory; weights are plain initializers we did not touch
            shallow = onnx.ModelProto()
            shallow.CopyFrom(model)
            for t in shallow.graph.initializer:
                t.ClearField("raw_data")
            onnx.checker.check_model(shallow)
    except onnx.checker.ValidationError as e:
        raise RewriteError(f"rewritten model fails onnx.checker: {str(e).strip().splitlines()[0]}") from None


def save_atomic(model: onnx.ModelProto, path: str | os.PathLike[str]) -> Path:
    """Write `model` to `path` so that a reader sees the old file or the whole new one, never a part.

    Models over 2 GB go to `path` plus a sibling `<name>.data` external-data file, both renamed into place.

    Raises:
        OutputError: the directory is missing or not writable.
    """
    out = Path(path)
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.is_dir():
        raise OutputError(f"{out}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise OutputError(f"{out}: directory {parent} is not writable")
    try:
        tmpdir = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=parent))
    except OSError as e:
        raise OutputError(f"{out}: cannot write in {parent}: {e.strerror}") from None
    try:
        tmp = tmpdir / out.name
        if model.ByteSize() < PROTOBUF_LIMIT:
            tmp.write_bytes(model.SerializeToString(deterministic=True))
            os.replace(tmp, out)
        else:
            data = out.name + ".data"
            onnx.save_model(model, str(tmp), save_as_external_data=True, all_tensors_to_one_file=True,
                            location=data, size_threshold=1024)
            os.replace(tmpdir / data, parent / data)
            os.replace(tmp, out)
    except OSError as e:
        raise OutputError(f"{out}: write failed: {e.strerror or e}") from None
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
    return out


def write_text_atomic(text: str, path: str | os.PathLike[str]) -> Path:
    """Atomic write of a text file (reports)."""
    out = Path(path)
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.is_dir():
        raise OutputError(f"{out}: directory {parent} does not exist")
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", dir=parent)
    except OSError as e:
        raise OutputError(f"{out}: cannot write in {parent}: {e.strerror}") from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, out)
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        raise OutputError(f"{out}: write failed: {e.strerror or e}") from None
    return out
