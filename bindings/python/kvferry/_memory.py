"""Address, length and location of the memory a Python object names.

kvferry registers raw address ranges. This module turns what a caller hands
to :meth:`kvferry.Engine.register` into such a range, without importing NumPy
or torch: a tensor is recognised by its ``data_ptr()`` method and ``device``
attribute, a NumPy array by its ``__array_interface__``, anything else must
export the buffer protocol. The object returned as ``keepalive`` must be kept
referenced while the range is registered: for buffer-protocol objects it holds
a buffer export, which also stops a ``bytearray`` from being resized (moved)
and an ``mmap`` from being closed under the engine.
"""

from __future__ import annotations

import ctypes
import operator
from dataclasses import dataclass
from typing import Any, Optional

# Mirrors the library's rule (kvf_register_memory): the first page is never
# a valid registration, so a small int is a caller's mistake caught early.
_MIN_ADDR = 4096
_MAX_U64 = (1 << 64) - 1


@dataclass(frozen=True)
class MemoryInfo:
    """A contiguous, writable range of memory named by a Python object.

    ``addr`` and ``length`` are bytes; ``location`` is kvferry's location
    string ("cpu", "cuda:0", ...); ``keepalive`` is what must stay referenced
    while the range is registered (None for a bare int address)."""

    addr: int
    length: int
    location: str
    keepalive: Any


def _as_int(value: Any, what: str) -> int:
    """An int from an int-like value (``__index__``), refusing floats, bools
    and strings with a TypeError that names the argument."""
    if isinstance(value, bool):
        raise TypeError(f"{what} must be an int, not bool")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{what} must be an int, not {type(value).__name__}") from None


def check_range(addr: Any, length: Any) -> tuple:
    """Validates an (address, length) pair given as ints; returns them as ints.

    Raises TypeError for non-integers and ValueError for negative, zero or
    out-of-range values, so that nothing reaches the library as a wrapped
    C integer."""
    a = _as_int(addr, "address")
    n = _as_int(length, "length")
    if a < 0 or a > _MAX_U64:
        raise ValueError(f"address {a:#x} is not a 64-bit address")
    if n <= 0:
        raise ValueError(f"length {n}: must be > 0")
    if a + n - 1 > _MAX_U64:
        raise ValueError(f"range [{a:#x}, +{n}) wraps around the address space")
    return a, n


def _is_tensor(obj: Any) -> bool:
    """A torch.Tensor (or a look-alike): ``data_ptr()`` plus ``device``."""
    return callable(getattr(obj, "data_ptr", None)) and hasattr(obj, "device")


def _is_ndarray(obj: Any) -> bool:
    """A NumPy array (or anything exposing the array interface on the host).

    Checked by attribute so that NumPy is never imported here."""
    return hasattr(obj, "__array_interface__") and not isinstance(obj, (bytes, bytearray, memoryview))


def _tensor_location(obj: Any) -> str:
    """"cpu" or "cuda:N" from a tensor's device (``torch.device`` or str)."""
    dev = obj.device
    kind = getattr(dev, "type", None)
    index = getattr(dev, "index", None)
    if kind is None:  # a plain string such as "cuda:1"
        text = str(dev)
        kind, _, idx = text.partition(":")
        index = int(idx) if idx else None
    if kind == "cpu":
        return "cpu"
    if index is None:
        # torch.device("cuda") has no index; the tensor knows its device.
        get = getattr(obj, "get_device", None)
        index = get() if callable(get) else 0
    return f"{kind}:{index}"


def _tensor_info(obj: Any, length: Optional[int]) -> MemoryInfo:
    contiguous = getattr(obj, "is_contiguous", None)
    if callable(contiguous) and not contiguous():
        raise ValueError("tensor is not contiguous: register a contiguous tensor (.contiguous())")
    addr = _as_int(obj.data_ptr(), "tensor.data_ptr()")
    if length is None:
        nbytes = getattr(obj, "nbytes", None)
        if nbytes is None:
            nbytes = obj.numel() * obj.element_size()
        length = _as_int(nbytes, "tensor size")
    addr, length = check_range(addr, length)
    return MemoryInfo(addr, length, _tensor_location(obj), obj)


def _ndarray_info(obj: Any, length: Optional[int]) -> MemoryInfo:
    iface = obj.__array_interface__
    ptr, readonly = iface["data"]
    if readonly:
        raise ValueError("array is read-only: kvferry registers memory that peers may write")
    flags = getattr(obj, "flags", None)
    if flags is not None and not (flags["C_CONTIGUOUS"] or flags["F_CONTIGUOUS"]):
        raise ValueError("array is not contiguous: register a contiguous array (numpy.ascontiguousarray)")
    if length is None:
        length = _as_int(obj.nbytes, "array.nbytes")
    addr, length = check_range(ptr, length)
    # The array itself keeps its memory alive; holding it also makes
    # ndarray.resize() refuse (it checks references).
    return MemoryInfo(addr, length, "cpu", obj)


def _buffer_info(obj: Any, length: Optional[int]) -> MemoryInfo:
    try:
        view = memoryview(obj)
    except TypeError:
        raise TypeError(
            f"cannot register a {type(obj).__name__}: pass an int address with a length, an object with the "
            "buffer protocol (bytearray, mmap, ctypes array, ...), a NumPy array or a tensor") from None
    with view:
        if view.readonly:
            raise ValueError(
                f"{type(obj).__name__} is read-only: kvferry registers memory that peers may write "
                "(use a bytearray, a writable mmap or a ctypes array)")
        if not view.c_contiguous:
            raise ValueError(f"{type(obj).__name__} buffer is not C-contiguous")
        nbytes = view.nbytes
    if nbytes == 0:
        raise ValueError("cannot register an empty buffer")
    # from_buffer takes a writable export that lasts as long as the ctypes
    # object: the memory cannot move or be released while it is referenced.
    export = (ctypes.c_char * nbytes).from_buffer(obj)
    addr = ctypes.addressof(export)
    if length is None:
        length = nbytes
    addr, length = check_range(addr, length)
    if length > nbytes:
        raise ValueError(f"length {length} exceeds the buffer's {nbytes} bytes")
    return MemoryInfo(addr, length, "cpu", export)


def is_int_like(obj: Any) -> bool:
    """Whether obj is an address: an int, or an int-like such as
    numpy.uint64 (``__index__``), but not a bool, an array or a tensor."""
    if isinstance(obj, bool):
        return False
    if isinstance(obj, int):
        return True
    return (hasattr(obj, "__index__") and not _is_tensor(obj)
            and not (_is_ndarray(obj) and getattr(obj, "ndim", 0) >= 1))


def memory_info(obj: Any, length: Optional[int] = None) -> MemoryInfo:
    """The memory range ``obj`` names.

    ``obj`` is an int address (then ``length`` is required), an object with
    ``data_ptr()`` and ``device`` (a torch tensor; location from its device),
    a NumPy array (``__array_interface__``), or any writable, C-contiguous
    object with the buffer protocol. ``length`` may shorten the range of an
    object. Read-only and non-contiguous objects are refused (ValueError);
    anything else that names no memory is a TypeError."""
    if length is not None:
        length = _as_int(length, "length")
    if isinstance(obj, bool):
        raise TypeError("cannot register a bool")
    if is_int_like(obj):
        if length is None:
            raise TypeError("an int address needs a length")
        addr, n = check_range(obj, length)
        return MemoryInfo(addr, n, "cpu", None)
    if _is_tensor(obj):
        return _tensor_info(obj, length)
    if _is_ndarray(obj):
        return _ndarray_info(obj, length)
    return _buffer_info(obj, length)


def address_of(obj: Any) -> int:
    """The start address of a buffer-protocol object, NumPy array or tensor,
    e.g. to compute the local address of an offset into registered memory.
    Read-only objects are refused like in :func:`memory_info`."""
    return memory_info(obj).addr
