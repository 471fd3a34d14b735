"""The memory alignment O_DIRECT asks of an open file's buffers, as the kernel reports it.

O_DIRECT constrains the buffer's address, the length and the file offset. The io engine keeps
lengths and offsets on its block (4096 bytes, the format's alignment); the address is what decides
whether a tensor can be written straight from its own memory. Many devices need far less than a
page there: the kernel reports the file's needs with ``statx(2)`` and ``STATX_DIOALIGN`` (Linux
6.1 and later; ``stx_dio_mem_align`` and ``stx_dio_offset_align``, ``include/uapi/linux/stat.h``).
Measured on a virtio disk with ext4: 512 bytes for both, and a write from an address 512 bytes
past a page succeeded while one 64 bytes past a page failed with EINVAL.

Python has no ``os.statx`` before 3.15, so the call goes through ``ctypes`` to the C library's
``statx`` wrapper (glibc 2.28 and later).
"""

from __future__ import annotations

import ctypes
import struct
from typing import Optional

STATX_DIOALIGN = 0x2000  # include/uapi/linux/stat.h
AT_EMPTY_PATH = 0x1000  # include/uapi/linux/fcntl.h: the fd itself, no path
STATX_SIZE = 256  # sizeof(struct statx)
_MASK_AT = 0  # __u32 stx_mask
_DIO_AT = 152  # __u32 stx_dio_mem_align, then __u32 stx_dio_offset_align


def _libc_statx():
    """The C library's ``statx`` function, or None where it has none (not Linux, an old C
    library)."""
    try:
        fn = ctypes.CDLL(None).statx
    except Exception:  # noqa: BLE001 - no C library to load (Windows: TypeError), or no statx in it
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_uint, ctypes.c_void_p)
    fn.restype = ctypes.c_int
    return fn


_STATX = _libc_statx()


def dio_memory_alignment(fd: int) -> Optional[int]:
    """The alignment, bytes (a power of two), that O_DIRECT operations on the open file ``fd``
    ask of a buffer's address (``stx_dio_mem_align``); None where the kernel does not say (no
    ``statx``, a kernel before 6.1, a file system that does not report it or does not take
    O_DIRECT for this file). Never raises."""
    if _STATX is None or fd < 0:
        return None
    buf = ctypes.create_string_buffer(STATX_SIZE)
    if _STATX(fd, b"", AT_EMPTY_PATH, STATX_DIOALIGN, buf) != 0:
        return None
    (mask,) = struct.unpack_from("=I", buf, _MASK_AT)  # the kernel's byte order
    mem, _offset = struct.unpack_from("=II", buf, _DIO_AT)
    if not mask & STATX_DIOALIGN or mem <= 0 or mem & (mem - 1):
        return None
    return mem


def file_memory_alignment(fd: int, direct: bool, block: int) -> int:
    """The address alignment, bytes, a buffer written to ``fd`` needs: 1 for buffered I/O (the
    kernel copies from any address); with O_DIRECT, :func:`dio_memory_alignment`, and ``block``
    (the engine's O_DIRECT block) where the kernel does not say."""
    if not direct:
        return 1
    return dio_memory_alignment(fd) or block
