"""Read a GGUF file's header (metadata and tensor infos) in a fraction of a second.

The gguf package's reader builds a numpy view for every element of every array, which for a
150k-token vocabulary and its merges costs 6-10 s and ~0.5 GB, in each process that opens the file.
Nothing here needs those strings (the tokenizer is built from the file by transformers), so arrays
of strings are skipped and only counted; numeric arrays are read as numpy arrays. Format:
https://github.com/ggml-org/ggml/blob/master/docs/gguf.md. No torch here: the launcher imports it.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

_MAGIC = b"GGUF"
_STRING, _ARRAY = 8, 9
# Value type id -> struct format of one scalar (little-endian).
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_DEFAULT_ALIGNMENT = 32


class HeaderError(ValueError):
    """The bytes are not a GGUF header this reader understands; the message says where it went wrong."""


class BigEndianFile(HeaderError):
    pass


@dataclass(frozen=True, slots=True)
class StringArray:
    """An array of strings left unread (the vocabulary, the merges): only its length."""

    count: int


@dataclass(frozen=True, slots=True)
class RawTensor:
    name: str
    dims: tuple[int, ...]  # ggml order: fastest-varying first
    type_id: int
    offset: int  # absolute byte offset of its data in the file


@dataclass(frozen=True, slots=True)
class Header:
    metadata: dict[str, Any]
    tensors: list[RawTensor]
    file_size: int


class _Cursor:
    def __init__(self, data: memoryview) -> None:
        self.data = data
        self.pos = 0

    def unpack(self, fmt: str) -> Any:
        try:
            value = struct.unpack_from(fmt, self.data, self.pos)[0]
        except struct.error:
            raise HeaderError(f"the header ends early, at byte {self.pos}") from None
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.unpack("<Q")
        end = self.pos + length
        if end > len(self.data):
            raise HeaderError(f"a string of {length} bytes at byte {self.pos} runs past the end of the file")
        raw = bytes(self.data[self.pos : end])
        self.pos = end
        return raw.decode("utf-8", errors="replace")

    def skip_strings(self, count: int) -> None:
        data, pos, size = self.data, self.pos, len(self.data)
        for _ in range(count):
            if pos + 8 > size:
                raise HeaderError(f"an array of strings runs past the end of the file at byte {pos}")
            pos += 8 + struct.unpack_from("<Q", data, pos)[0]
        if pos > size:
            raise HeaderError("an array of strings runs past the end of the file")
        self.pos = pos

    def value(self, type_id: int) -> Any:
        if type_id == _STRING:
            return self.string()
        if type_id == _ARRAY:
            item_type, count = self.unpack("<I"), self.unpack("<Q")
            if item_type == _STRING:
                self.skip_strings(count)
                return StringArray(count)
            if item_type not in _SCALARS:
                raise HeaderError(f"an array of value type {item_type} at byte {self.pos}")
            dtype = np.dtype(_SCALARS[item_type])
            end = self.pos + count * dtype.itemsize
            if end > len(self.data):
                raise HeaderError(f"an array of {count} values at byte {self.pos} runs past the end of the file")
            array = np.frombuffer(self.data, dtype=dtype, count=count, offset=self.pos).copy()
            self.pos = end
            return array
        if type_id not in _SCALARS:
            raise HeaderError(f"value type {type_id} at byte {self.pos}")
        return self.unpack(_SCALARS[type_id])


def read_header(path: Path) -> Header:
    """Metadata (scalars and strings as Python values, numeric arrays as numpy arrays, string arrays as
    StringArray) and tensor infos. Raises HeaderError (BigEndianFile for a big-endian file), OSError."""
    with open(path, "rb") as file:
        size = file.seek(0, 2)
        if size < 24:
            raise HeaderError(f"{size} bytes is too short for a GGUF header")
        with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as mapping:
            view = memoryview(mapping)
            try:
                return _parse(_Cursor(view), size)
            finally:
                view.release()


def _parse(cursor: _Cursor, size: int) -> Header:
    if bytes(cursor.data[:4]) != _MAGIC:
        raise HeaderError(f"magic {bytes(cursor.data[:4])!r} is not {_MAGIC!r}")
    cursor.pos = 4
    version = cursor.unpack("<I")
    if version > 0xFFFF and struct.unpack("<I", struct.pack(">I", version))[0] in (2, 3):
        raise BigEndianFile("big-endian")
    if version not in (2, 3):
        raise HeaderError(f"GGUF version {version} (2 and 3 are read)")
    num_tensors, num_kv = cursor.unpack("<Q"), cursor.unpack("<Q")
    metadata: dict[str, Any] = {}
    for _ in range(num_kv):
        key = cursor.string()
        metadata[key] = cursor.value(cursor.unpack("<I"))
    raw = []
    for _ in range(num_tensors):
        name = cursor.string()
        n_dims = cursor.unpack("<I")
        if n_dims > 4:
            raise HeaderError(f"tensor {name} has {n_dims} dimensions")
        dims = tuple(cursor.unpack("<Q") for _ in range(n_dims))
        raw.append((name, dims, cursor.unpack("<I"), cursor.unpack("<Q")))
    alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
    if alignment <= 0:
        raise HeaderError(f"general.alignment is {alignment}")
    data_start = -(-cursor.pos // alignment) * alignment
    tensors = [RawTensor(name, dims, type_id, data_start + offset) for name, dims, type_id, offset in raw]
    return Header(metadata, tensors, size)
