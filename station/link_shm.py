"""Hidden rows through shared memory between two stations on one host (station.relay_link's SHM frames).

A MiB of rows and its answer take 0.37 ms through loopback TCP and the sender 0.30 ms of CPU; through a mapped file,
one memcpy on each side, 0.16 ms and 0.08 ms (`python bench/link_hop.py`, bench/out/session32_shm.txt). So where both
ends of a relay link share a host, the client offers each connection one segment: a file it creates under /dev/shm (mode
0600, its pages reserved at once, so that a full tmpfs is an error now and not a bus error later) whose first bytes
hold a random nonce. The station opens the file the offer names (only a name of the form below: a regular file of
this user, of the announced size), finds the nonce (so both ends see one file, on one host), maps it and accepts;
the client then unlinks the name, so nothing stays in /dev/shm whatever happens to either process later (a client
killed inside that one round trip leaves its file behind: 4 MiB named wavemesh-rows-*). From there a
request whose rows fit goes as REQUEST_SHM: the rows are written into the segment, only the message crosses the
socket, and the station reads them where they lie, with no copy out: the client writes the segment again only after
the reply, which comes after the station's step (and, relaying, its successors'), and a client whose call fails
closes the connection and its segment rather than reuse them. A client that broke that rule (wrote rows after the
station checked them finite) would be a process of the station's own user on its host holding the cluster token,
which could as well kill the station; and what it reached would be its own wave's rows, which it could as well
have sent wrong but finite, to the same effect on every KV block they fill: a private copy guarded nothing.
A relaying station's step likewise writes its rows straight into its successor's segment (`rows`, through
station.relay_link_client.Announced.rows_space), so a hop's MiB is written once and read once, in place. On another
host the name is not found, the station declines, and the connection goes on over TCP as before.
"""
from __future__ import annotations

import ctypes
import hmac
import mmap
import os
import re
import secrets
import stat
import struct

import numpy as np

SHM_DIR = "/dev/shm"
SEGMENT_BYTES = 4 << 20  # a relaying station's segment per connection: a 64-row wave of 8192-wide float32 is 2 MiB
NAME = re.compile(r"wavemesh-rows-[0-9a-f]{32}")
NONCE_BYTES = 16
OFFER = struct.Struct("<16sQ")  # the nonce, the segment's bytes; the file's name (ASCII) follows


class RowsSegment:
    """One connection's mapped segment: the client writes a request's rows into it, the station reads them out."""

    def __init__(self, mapped: mmap.mmap) -> None:
        self.size = len(mapped)
        self._mapped = mapped
        self._view = memoryview(mapped)
        self._address = ctypes.addressof(ctypes.c_char.from_buffer(mapped))  # the export ends with the temporary

    @classmethod
    def create(cls, size: int, directory: str = SHM_DIR) -> tuple["RowsSegment", bytes, str] | None:
        """A new segment of `size` bytes, the body of its offer and its path (to unlink once the offer is
        answered); None where the host has no such directory, no room for it, or no way to reserve its pages."""
        if not hasattr(os, "posix_fallocate"):  # not Linux: TCP it is
            return None
        name = f"wavemesh-rows-{secrets.token_hex(16)}"
        path = os.path.join(directory, name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError:
            return None
        try:
            os.posix_fallocate(fd, 0, size)
            mapped = mmap.mmap(fd, size)
        except OSError:
            os.unlink(path)
            return None
        finally:
            os.close(fd)
        nonce = secrets.token_bytes(NONCE_BYTES)
        mapped[:NONCE_BYTES] = nonce
        return cls(mapped), OFFER.pack(nonce, size) + name.encode(), path

    @classmethod
    def attach(cls, offer: bytes | bytearray, max_bytes: int, directory: str = SHM_DIR) -> "RowsSegment":
        """The segment an offer names, mapped; ValueError naming what is wrong with the offer."""
        if len(offer) <= OFFER.size:
            raise ValueError(f"shared-memory offer: {len(offer)} bytes, too short to name a segment")
        nonce, size = OFFER.unpack_from(offer)
        name = bytes(offer[OFFER.size:]).decode("ascii", errors="replace")
        if not NAME.fullmatch(name):
            raise ValueError(f"shared-memory offer: {name[:80]!r} is not a segment name")
        if not NONCE_BYTES <= size <= max_bytes:
            raise ValueError(f"shared-memory offer: {size} bytes, outside [{NONCE_BYTES}, {max_bytes}]")
        try:
            fd = os.open(os.path.join(directory, name), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as err:
            raise ValueError(f"shared-memory offer: cannot open {name} ({err.strerror}; another host?)") from None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_size != size:
                raise ValueError(f"shared-memory offer: {name} is not a {size}-byte file of this user")
            mapped = mmap.mmap(fd, size)
        except OSError as err:
            raise ValueError(f"shared-memory offer: cannot map {name} ({err.strerror})") from None
        finally:
            os.close(fd)
        if not hmac.compare_digest(mapped[:NONCE_BYTES], nonce):
            mapped.close()
            raise ValueError(f"shared-memory offer: {name} does not hold the offer's nonce")
        return cls(mapped)

    def write(self, rows: memoryview) -> None:
        """Put a request's rows (bytes, at most `size`) at the start of the segment, unless they are there already
        (a step wrote them into `rows(n)`)."""
        if not self.holds(rows):
            self._view[:rows.nbytes] = rows

    def holds(self, rows: memoryview) -> bool:
        """True where `rows` is the segment's own memory from its first byte (nothing to copy)."""
        return self.holds_at(np.frombuffer(rows, np.uint8).ctypes.data, rows.nbytes)

    def holds_at(self, address: int, nbytes: int) -> bool:
        """True where `nbytes` at `address` are the segment's own memory from its first byte (a tensor's
        `data_ptr()`: checked without making a view of it)."""
        return nbytes <= self.size and address == self._address

    def rows(self, n: int) -> memoryview:
        """The first `n` bytes of the segment, in place (writable: a tensor over them is the station's input, read
        without a copy; 1 MiB copied out took 0.08-0.16 ms of a relaying station's CPU on every hop)."""
        return self._view[:n]

    def close(self) -> None:
        """Unmap the segment (the file's name is already gone: its pages go with the last mapping). Where a tensor
        over its rows still lives, the mapping goes with that tensor instead."""
        self._view.release()
        try:
            self._mapped.close()
        except BufferError:  # a view of the rows is still held: unmapped when it is collected
            pass
