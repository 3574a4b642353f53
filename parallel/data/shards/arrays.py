"""A .npy file read a chunk of rows at a time, in bounded memory (launch/make_shards.py's arrays).

Memory-mapping the inputs keeps every page read resident in the process until the end (its peak RSS grew with
the data: 1.3 GiB for 1 GB of arrays); here each chunk is read with plain file reads into one buffer that
every chunk uses again, so the process holds a chunk, whatever the size of the file.
"""
from __future__ import annotations

import math
import os

import numpy as np

from parallel.config import ConfigError


class NpyRows:
    """The rows (first dimension) of the array in a .npy file, read `rows(lo, hi)` at a time.

    Args:
        path: the .npy file; its header is read here, its data by `rows`.
    Raises:
        OSError, ValueError: the file cannot be opened or is not a .npy array (as `np.load` would raise).
    """

    def __init__(self, path: str | os.PathLike):
        self.path = str(path)
        self._file = open(path, "rb")
        try:
            version = np.lib.format.read_magic(self._file)
            read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else \
                np.lib.format.read_array_header_2_0
            self.shape, self.fortran, self.dtype = read_header(self._file)
        except Exception:
            self._file.close()
            raise
        if self.dtype.hasobject:
            self._file.close()
            raise ValueError("an array of Python objects (pickled), not of numbers")
        self.offset = self._file.tell()
        self._buf = np.empty(0, self.dtype)

    def __len__(self) -> int:
        return self.shape[0]

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def rows(self, lo: int, hi: int) -> np.ndarray:
        """Rows lo..hi-1 as an array of shape (hi - lo, *shape[1:]). It is a view of a buffer that the next call
        overwrites: copy what must outlive it."""
        m, rest = hi - lo, self.shape[1:]
        if self._buf.size < m * math.prod(rest):
            self._buf = np.empty(m * math.prod(rest), self.dtype)
        if not self.fortran:
            out = self._buf[:m * math.prod(rest)]
            self._read(self.offset + lo * out.itemsize * math.prod(rest), out)
            return out.reshape((m, *rest))
        # Fortran order stores each column (one trailing index, every row) contiguously: a chunk of rows is
        # one run per column, read into a row of `grid`; the columns count in Fortran order over `rest`.
        columns = math.prod(rest)
        grid = self._buf[:m * columns].reshape(columns, m)
        for c in range(columns):
            self._read(self.offset + (c * len(self) + lo) * grid.itemsize, grid[c])
        return grid.T.reshape((m, *rest), order="F")

    def _read(self, offset: int, out: np.ndarray) -> None:
        self._file.seek(offset)
        if self._file.readinto(out.view(np.uint8)) != out.nbytes:
            raise ConfigError(f"{self.path!r}: shorter than its header says (a truncated .npy file)")

    def close(self) -> None:
        self._file.close()
