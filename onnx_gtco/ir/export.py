"""Validate a rewritten model and save it atomically (temp files, then rename), external data past 2 GB."""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from pathlib import Path
from typing import BinaryIO

import onnx

from onnx_gtco.errors import OutputError, RewriteError, first_line
from onnx_gtco.ir.load import (
    PROTOBUF_LIMIT,
    checker_line,
    copy_fields,
    external_entries,
    external_tensors,
    weightless,
    without_initializers,
)


def _on_disk(model: onnx.ModelProto) -> bool:
    """True when a tensor of the model still refers to external data (large weights kept on disk by the loader)."""
    return bool(external_tensors(model))


def validate(model: onnx.ModelProto, loaded: onnx.ModelProto | None = None) -> None:
    """Full ONNX check of a rewritten model (strict shape inference through the local functions).

    Args:
        model: the rewritten model.
        loaded: the model it was rewritten from, as load_model gave it. Where that one fails strict shape inference
            itself (onnx cannot infer some valid models, e.g. through the function bodies of a few standard ops),
            the rewritten model is held to the plain check only: the failure is not the rewrite's.

    Raises:
        RewriteError: the rewritten model fails the check.
    """
    checked = weightless(model)  # weights on disk or over 2 GB: their initializers are checked as graph inputs
    try:
        onnx.checker.check_model(checked, full_check=True)
    except onnx.checker.ValidationError as e:
        raise RewriteError(f"rewritten model fails onnx.checker: {checker_line(e)}") from None
    except onnx.shape_inference.InferenceError as e:
        if loaded is None or _infers_strictly(loaded):
            raise RewriteError(f"rewritten model fails onnx shape inference: {first_line(e)}") from None
        try:
            onnx.checker.check_model(checked)
        except onnx.checker.ValidationError as e2:
            raise RewriteError(f"rewritten model fails onnx.checker: {checker_line(e2)}") from None


def _infers_strictly(model: onnx.ModelProto) -> bool:
    """Whether onnx's strict shape inference (what check_model's full check runs) passes on the model."""
    try:
        onnx.shape_inference.infer_shapes(weightless(model), check_type=True, strict_mode=True)
    except onnx.shape_inference.InferenceError:
        return False
    return True


def _tensor_shell(t: onnx.TensorProto) -> onnx.TensorProto:
    """A tensor's name, type and dims without its data."""
    out = onnx.TensorProto()
    copy_fields(t, out, ("raw_data", "external_data", "data_location", "float_data", "int32_data", "int64_data",
                          "double_data", "uint64_data", "string_data"))
    return out


def writable_parent(path: str | os.PathLike[str]) -> Path:
    """The folder `path` is written into, checked to exist and be writable (before any work that would be lost).

    Raises:
        OutputError: naming the path and the folder.
    """
    out = Path(path)
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.is_dir():
        raise OutputError(f"{out}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise OutputError(f"{out}: directory {parent} is not writable")
    return parent


def save_atomic(model: onnx.ModelProto, path: str | os.PathLike[str]) -> Path:
    """Write `model` to `path` so that a reader sees the old file or the whole new one, never a part.

    Models over 2 GB, and models whose large weights the loader kept on disk (their external data references carry
    a `basepath`), go to `path` plus a sibling `<name>.data` file holding every initializer of 1 KiB or more, both
    renamed into place; weights on disk are copied file to file (holes kept), never read in whole.

    Raises:
        OutputError: the directory is missing or not writable.
    """
    out = Path(path)
    parent = writable_parent(out)
    try:
        tmpdir = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=parent))
    except OSError as e:
        raise OutputError(f"{out}: cannot write in {parent}: {e.strerror}") from None
    try:
        tmp = tmpdir / out.name
        if model.ByteSize() < PROTOBUF_LIMIT and not _on_disk(model):
            tmp.write_bytes(model.SerializeToString(deterministic=True))
            os.replace(tmp, out)
        else:
            data = out.name + ".data"
            shell = _write_external(model, tmpdir / data, data)
            if shell.ByteSize() >= PROTOBUF_LIMIT:
                raise OutputError(f"{out}: over 2 GB even with the initializers as external data (large tensors "
                                  "in Constant nodes or functions)")
            tmp.write_bytes(shell.SerializeToString(deterministic=True))
            os.replace(tmpdir / data, parent / data)
            try:
                os.replace(tmp, out)
            except OSError:
                (parent / data).unlink(missing_ok=True)
                raise
    except OSError as e:
        raise OutputError(f"{out}: write failed: {e.strerror or e}") from None
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
    return out


def remove_saved(path: str | os.PathLike[str]) -> None:
    """Remove what save_atomic wrote at `path`: the model and its `<name>.data` file (when there is one); for
    undoing a write whose companion files (report, library) could not be written."""
    out = Path(path)
    for p in (out, out.with_name(out.name + ".data")):
        p.unlink(missing_ok=True)


EXTERNAL_MIN_BYTES = 1024
_ALIGN = 4096
_CHUNK = 16 << 20


def _write_external(model: onnx.ModelProto, data_path: Path, location: str) -> onnx.ModelProto:
    """Write the model's initializers of EXTERNAL_MIN_BYTES or more into data_path (each at a 4 KiB aligned
    offset) and return a copy of the model whose initializers refer to it; `model` is left as it is."""
    shell = without_initializers(model)
    with open(data_path, "wb") as dst:
        end = 0
        for t in model.graph.initializer:
            info = external_entries(t) if t.data_location == onnx.TensorProto.EXTERNAL else None
            if info is None and len(t.raw_data) < EXTERNAL_MIN_BYTES:
                shell.graph.initializer.append(t)
                continue
            offset = -(-end // _ALIGN) * _ALIGN
            if info is not None:
                src = Path(info.get("basepath", ".")) / info["location"]
                start = int(info.get("offset", 0))
                length = int(info["length"]) if "length" in info else src.stat().st_size - start
                _copy_range(src, start, length, dst, offset)
            else:  # raw bytes (typed-field tensors have no raw_data and stayed inline above)
                length = len(t.raw_data)
                os.pwrite(dst.fileno(), t.raw_data, offset)
            end = offset + length
            ext = _tensor_shell(t)
            ext.data_location = onnx.TensorProto.EXTERNAL
            for k, v in (("location", location), ("offset", str(offset)), ("length", str(length))):
                ext.external_data.add(key=k, value=v)
            shell.graph.initializer.append(ext)
        os.ftruncate(dst.fileno(), end)
    return shell


def _copy_range(src: Path, start: int, length: int, dst: BinaryIO, at: int) -> None:
    """Copy bytes start..start+length of src to dst at offset `at`, in chunks, skipping the holes of a sparse
    source (the destination keeps them as holes)."""
    with open(src, "rb") as f:
        fd, out = f.fileno(), dst.fileno()
        pos, stop = start, start + length
        while pos < stop:
            try:
                data = min(os.lseek(fd, pos, os.SEEK_DATA), stop)
                hole = min(os.lseek(fd, data, os.SEEK_HOLE), stop) if data < stop else stop
            except OSError as e:  # ENXIO: only a hole until the end; EINVAL etc.: no hole support, copy it all
                if e.errno == errno.ENXIO:
                    break
                data, hole = pos, stop
            while data < hole:
                n = min(_CHUNK, hole - data)
                os.pwrite(out, os.pread(fd, n, data), at + data - start)
                data += n
            pos = hole


def file_mode() -> int:
    """The mode a new file gets from open(): 0o666 less the umask (mkstemp's own files are 0o600)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def write_text_atomic(text: str, path: str | os.PathLike[str]) -> Path:
    """Atomic write of a text file (reports), with the mode open() would give it."""
    return write_bytes_atomic(text.encode("utf-8"), path)


def write_bytes_atomic(data: bytes, path: str | os.PathLike[str]) -> Path:
    """Write `data` to `path` so that a reader sees the old file or the whole new one, with the mode open() would
    give it.

    Raises:
        OutputError: the directory is missing or not writable, or the write failed (nothing is left behind).
    """
    out = Path(path)
    parent = writable_parent(out)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", dir=parent)
    except OSError as e:
        raise OutputError(f"{out}: cannot write in {parent}: {e.strerror}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            os.fchmod(f.fileno(), file_mode())
        os.replace(tmp, out)
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        raise OutputError(f"{out}: write failed: {e.strerror or e}") from None
    return out
