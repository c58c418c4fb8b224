"""Checking a zip archive while it is written: each member's CRC-32 computed from the bytes as
they stream past, so a followed checkpoint (``follow.py``) needs no second read to prove it whole.

A ``.pt`` is a zip of stored (uncompressed) members. torch's writer (miniz) puts zeros in each
local header and a data descriptor (``PK\\x07\\x08``, CRC-32, sizes) after the data; Python's
``zipfile`` puts the sizes in the header. :class:`ZipStream` handles both: it parses local
headers, runs each member's data through ``zlib.crc32`` as it arrives, and finds the end of a
member of unknown length where a descriptor sits whose CRC-32 and sizes match the bytes before
it and a signature follows. It stops at the central directory.

:meth:`ZipStream.matches` then holds the archive's own central directory (read from the finished
copy: a few KB) against what streamed past: the same members at the same offsets, each CRC-32 and
size equal, every member stored. That is what ``zipfile.ZipFile.testzip`` proves, without reading
the data again. Anything unexpected (a compressed or encrypted member, a descriptor without its
signature, a header rewritten in place) makes the stream ``broken``; the caller then checks the
copy the slow way. A wrong guess can only cost that second read, never pass a bad archive: the
central directory, written last, has the final word.
"""

from __future__ import annotations

import struct
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

_LOCAL = b"PK\x03\x04"
_DESCRIPTOR = b"PK\x07\x08"
#: Central directory, zip64 end of central directory, end of central directory.
_DIRECTORY = (b"PK\x01\x02", b"PK\x06\x06", b"PK\x05\x06")
_HEADER = struct.Struct("<4sHHHHHIIIHH")  # 30 bytes
#: The longest data descriptor (zip64 sizes: signature, CRC-32, two 8-byte sizes) and the
#: signature after it (the next member's header or the central directory): what must be here
#: before a possible descriptor is judged.
_LOOKAHEAD = 24 + 4
_FLAG_ENCRYPTED = 0x1
_FLAG_DESCRIPTOR = 0x8
_FLAG_UTF8 = 0x800


@dataclass(frozen=True)
class Member:
    """One member as it streamed past."""

    offset: int
    name: str
    crc: int
    size: int
    #: Where its data starts (after the local header); the data's bytes are the CRC's.
    data_at: int = 0


class ZipStream:
    """Feed it an archive's bytes in order from the first (:meth:`feed`); it checks each
    member's CRC-32 on the way. ``broken`` says why it gave up (then check the file the slow
    way); ``directory_at`` is where the central directory starts, once seen."""

    def __init__(self) -> None:
        self.members: list[Member] = []
        self.broken: str | None = None
        self.directory_at: int | None = None
        self._pending = bytearray()  # header or descriptor bytes not parsed yet
        self._at = 0  # archive offset of the first byte of _pending / of the data fed next
        # The member being read: (offset, name, flags, crc in header, size in header)
        self._member: tuple[int, str, int, int, int] | None = None
        self._data_at = 0  # archive offset where its data starts
        self._crc = 0
        self._left: int | None = None  # data bytes still to come, when the header said

    @property
    def done(self) -> bool:
        return self.broken is not None or self.directory_at is not None

    def feed(self, data: bytes | memoryview) -> None:
        view = memoryview(data)
        while view and not self.done:
            if self._member is None:
                view = self._header(view)
            elif self._left is not None:
                view = self._known(view)
            else:
                view = self._unknown(view)

    # ------------------------------------------------------------ parsing

    def _header(self, view: memoryview) -> memoryview:
        need = _HEADER.size - len(self._pending)
        if need > 0:
            self._pending += view[:need]
            view = view[need:]
            if len(self._pending) < 4:
                return view
            if bytes(self._pending[:4]) in _DIRECTORY:
                self.directory_at = self._at
                return view[:0]
            if len(self._pending) < _HEADER.size:
                return view
        sig, _, flags, method, _, _, crc, csize, usize, nlen, xlen = _HEADER.unpack_from(
            self._pending
        )
        if sig != _LOCAL:
            return self._give_up(f"no local header at offset {self._at}")
        need = _HEADER.size + nlen + xlen - len(self._pending)
        if need > 0:
            self._pending += view[:need]
            view = view[need:]
            if len(self._pending) < _HEADER.size + nlen + xlen:
                return view
        if method != zipfile.ZIP_STORED or flags & _FLAG_ENCRYPTED:
            return self._give_up(f"member at offset {self._at} is compressed or encrypted")
        raw = bytes(self._pending[_HEADER.size : _HEADER.size + nlen])
        name = raw.decode("utf-8" if flags & _FLAG_UTF8 else "cp437")
        if not flags & _FLAG_DESCRIPTOR and (csize != usize or csize == 0xFFFFFFFF):
            return self._give_up(f"member {name!r}: sizes this stream cannot follow")
        self._member = (self._at, name, flags, crc, usize)
        self._at += len(self._pending)
        self._data_at = self._at
        self._pending.clear()
        self._crc = 0
        self._left = None if flags & _FLAG_DESCRIPTOR else usize
        return view

    def _known(self, view: memoryview) -> memoryview:
        assert self._member is not None and self._left is not None
        take = view[: self._left]
        self._crc = zlib.crc32(take, self._crc)
        self._left -= len(take)
        self._at += len(take)
        if self._left == 0:
            offset, name, _, crc, size = self._member
            if self._crc != crc:
                return self._give_up(f"member {name!r}: CRC-32 does not match its header")
            self._end(Member(offset, name, crc, size, self._data_at))
        return view[len(take) :]

    def _unknown(self, view: memoryview) -> memoryview:
        """Data of unknown length: it ends where a descriptor matches the bytes before it.
        The last bytes are held back (in ``_pending``) until a descriptor there can be read
        whole."""
        buf = bytes(self._pending) + bytes(view) if self._pending else bytes(view)
        whole = memoryview(buf)
        done = 0  # bytes of buf already in self._crc
        start = 0
        while (i := buf.find(_DESCRIPTOR, start)) >= 0:
            if i + _LOOKAHEAD > len(buf):
                break  # maybe a descriptor: decide when its bytes are here
            self._crc = zlib.crc32(whole[done:i], self._crc)
            done = i
            size = self._at + i - self._data_at
            crc, s32, u32 = struct.unpack_from("<III", buf, i + 4)
            crc64, s64, u64 = struct.unpack_from("<IQQ", buf, i + 4)
            length = 16 if (crc, s32, u32) == (self._crc, size, size) else 0
            if not length and (crc64, s64, u64) == (self._crc, size, size):
                length = 24
            # Tensor bytes can look like a descriptor; a real one is followed by a signature.
            if length and buf[i + length : i + length + 4] in (_LOCAL, *_DIRECTORY):
                assert self._member is not None
                offset, name, _, _, _ = self._member
                self._at += i + length
                self._pending.clear()
                self._end(Member(offset, name, self._crc, size, self._data_at))
                return whole[i + length :]
            start = i + 1
        keep = max(done, len(buf) - (_LOOKAHEAD - 1))
        if i >= 0:
            keep = min(keep, i)
        keep = max(keep, done)
        self._crc = zlib.crc32(whole[done:keep], self._crc)
        self._at += keep
        self._pending = bytearray(buf[keep:])
        return memoryview(b"")

    def unchecked(self, end: int) -> list[tuple[int, int]]:
        """The byte ranges ``[start, stop)`` of ``[0, end)`` that no member's CRC-32 covers:
        local headers, data descriptors, the central directory. With :meth:`matches`, a copy
        equal to its file in these ranges holds the file's bytes in all the others too (each
        member's data has the CRC-32 the writer put in the directory)."""
        ranges: list[tuple[int, int]] = []
        at = 0
        for m in sorted(self.members, key=lambda m: m.data_at):
            if m.data_at > at:
                ranges.append((at, m.data_at))
            at = max(at, m.data_at + m.size)
        if end > at:
            ranges.append((at, end))
        return ranges

    def _end(self, member: Member) -> None:
        self.members.append(member)
        self._member = None
        self._left = None

    def _give_up(self, why: str) -> memoryview:
        self.broken = why
        return memoryview(b"")

    # ------------------------------------------------------------ the verdict

    def matches(self, path: Path) -> bool:
        """Whether ``path`` (the finished copy of the streamed bytes) is an archive whose central
        directory lists exactly the members that streamed past, each intact. False, never an
        exception, when it is not (or the stream gave up): check it the slow way then."""
        if self.broken is not None or self.directory_at is None:
            return False
        try:
            with zipfile.ZipFile(path) as zf:
                infos = zf.infolist()
                start_dir = getattr(zf, "start_dir", None)
        except (OSError, zipfile.BadZipFile, EOFError, ValueError):
            return False
        if start_dir != self.directory_at or len(infos) != len(self.members):
            return False
        streamed = {m.offset: m for m in self.members}
        for info in infos:
            m = streamed.get(info.header_offset)
            if (
                m is None
                or m.name != info.filename
                or info.compress_type != zipfile.ZIP_STORED
                or (m.crc, m.size, m.size) != (info.CRC, info.file_size, info.compress_size)
            ):
                return False
        return True
