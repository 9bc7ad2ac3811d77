"""A node's disk cache of the packed weights a station builds from a GGUF, so a later station maps them instead.

Packing a GGUF station's weights (repacking its blocks into quant_linear's tiles, or packing dequantized matrices
into packed_linear's) writes every byte into fresh memory, which is most of the load; loading from safetensors only
maps the file. With a cache directory set (StationSpec.packed_cache), each layer's packed weights are written to one
file after the first load that packs them, and a later station holding that layer (a restart, a replay, a re-split
by `mesh scale`) memory-maps it as it would a safetensors file: nothing read until a step reads it.

Layout: ROOT/<source key>/source.json names the GGUF (its resolved path, size, mtime and inode); beside it, one
`<group>.bin` per layer (or `lm_head`): a header (MAGIC, then the length and JSON of the entry's description: the
source, the group, LAYOUT_VERSION and each tensor's shape and dtype), then the tensors, each at a 64-byte aligned
offset from the first page after the header. An entry whose description differs in anything (the GGUF changed,
the layout's version moved on, other shapes) is not used: the station packs afresh and replaces it. Entries are
written to a temporary file and renamed into place, so a reader sees a whole file or none; a store also removes
the directories of GGUFs that are gone or changed, and temporary files left by a store whose process died.
Mapped weights are the page cache's, as a memory-mapped checkpoint's are: under memory pressure the kernel may drop
them and read them again. The entries are trusted as the checkpoint is: their bytes carry no checksum (checking one
would read every byte at the load the cache exists to avoid); delete the directory to drop them.
"""
from __future__ import annotations

import hashlib
import json
import mmap
import os
import shutil
import struct
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from mesh.core.model.host_memory import PAGE, aligned, tensor_bytes

MAGIC = b"WMPACKED"
LAYOUT_VERSION = 4  # bump when quant_repack.c's or packed_linear.c's tile layout, or a layer's order of weights, changes
_HEAD = struct.Struct("<8sQ")  # MAGIC, the JSON description's length
ORPHAN_S = 3600.0  # a temporary entry file this old belongs to a store whose process died: removed
MIN_FREE_FRACTION = 0.10  # a store that would leave less of its disk free than this writes nothing


_STORES: list[threading.Thread] = []  # this process's store threads not yet seen finished
_STORES_LOCK = threading.Lock()


def wait_for_stores(timeout: float) -> bool:
    """Wait up to `timeout` seconds for this process's cache stores to finish; True when none is left running."""
    with _STORES_LOCK:
        pending = list(_STORES)
    deadline = time.monotonic() + timeout
    for t in pending:
        t.join(max(0.0, deadline - time.monotonic()))
    return not any(t.is_alive() for t in pending)


def source_identity(path: str | Path) -> dict[str, object]:
    """What names one GGUF file's contents: its resolved path, size, modification time (ns) and inode."""
    p = Path(path).resolve()
    st = p.stat()
    return {"path": str(p), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "inode": st.st_ino}


def _data_start(header_bytes: int) -> int:
    return -(-(_HEAD.size + header_bytes) // PAGE) * PAGE


def _entry_bytes(header_bytes: int, shapes: Sequence[tuple[tuple[int, ...], torch.dtype]]) -> int:
    """The size of an entry whose description is `header_bytes` long, holding tensors of these shapes."""
    return _data_start(header_bytes) + sum(aligned(tensor_bytes(*s)) for s in shapes)


@dataclass(frozen=True, slots=True)
class PackedCache:
    """The cache entries of one GGUF under `root`."""

    root: Path
    source: dict[str, object]  # source_identity of the GGUF

    @classmethod
    def for_gguf(cls, root: str | Path, gguf: str | Path) -> PackedCache:
        """The cache of `gguf` under `root` (~ expanded on this node)."""
        return cls(Path(root).expanduser(), source_identity(gguf))

    @property
    def directory(self) -> Path:
        """Where this GGUF's entries live."""
        return self.root / hashlib.sha256(str(self.source["path"]).encode()).hexdigest()[:16]

    def _describe(self, group: str, shapes: Sequence[tuple[tuple[int, ...], torch.dtype]]) -> bytes:
        return json.dumps({"version": LAYOUT_VERSION, "source": self.source, "group": group,
                           "tensors": [[list(shape), str(dtype)] for shape, dtype in shapes]},
                          sort_keys=True).encode()

    def load(self, group: str, shapes: Sequence[tuple[tuple[int, ...], torch.dtype]]) -> list[torch.Tensor] | None:
        """The group's packed tensors mapped from its entry (read-only in effect: pages are read on use), or None
        where there is no entry for exactly this GGUF, layout and these shapes (or it cannot be read)."""
        want = self._describe(group, shapes)
        try:
            with open(self.directory / f"{group}.bin", "rb") as f:
                magic, n = _HEAD.unpack(f.read(_HEAD.size))
                if magic != MAGIC or n != len(want) or f.read(n) != want:
                    return None
                start, total = _data_start(n), _entry_bytes(n, shapes)
                if os.fstat(f.fileno()).st_size != total:
                    return None
                region = mmap.mmap(f.fileno(), total, access=mmap.ACCESS_COPY)  # private: never written back
        except (OSError, ValueError, struct.error):
            return None
        out, offset = [], start
        for shape, dtype in shapes:
            nbytes = tensor_bytes(shape, dtype)
            out.append(torch.frombuffer(region, dtype=torch.uint8, count=nbytes, offset=offset).view(dtype).view(shape))
            offset += aligned(nbytes)
        return out

    def store(self, groups: dict[str, list[torch.Tensor]]) -> None:
        """Write each group's packed tensors as its entry (replacing any), after removing the entries of GGUFs that
        are gone or changed; nothing where the disk would be left with less than MIN_FREE_FRACTION of it free
        (the cache never fills a disk). Errors (no permission, a full disk all the same) leave the cache without
        these entries."""
        try:
            self._sweep()
            self.directory.mkdir(parents=True, exist_ok=True)
            self._drop_orphans()
            shapes = {group: [(tuple(t.shape), t.dtype) for t in ts] for group, ts in groups.items()}
            need = sum(_entry_bytes(len(self._describe(group, s)), s) for group, s in shapes.items())
            usage = shutil.disk_usage(self.directory)
            if usage.free - need < MIN_FREE_FRACTION * usage.total:
                print(f"wavemesh packed cache: {need / 2**20:.0f} MiB not stored under {self.directory}: the disk "
                      f"would keep less than {MIN_FREE_FRACTION:.0%} free ({usage.free / 2**30:.1f} GiB free of "
                      f"{usage.total / 2**30:.1f})", file=sys.stderr, flush=True)
                return
            (self.directory / "source.json").write_text(json.dumps(self.source, sort_keys=True))
            for group, tensors in groups.items():
                self._write(group, tensors)
        except OSError:
            return

    def store_in_background(self, groups: dict[str, list[torch.Tensor]]) -> None:
        """`store` on a thread (the station serves meanwhile; the tensors are only read): see wait_for_stores."""
        thread = threading.Thread(target=self.store, args=(groups,), name="packed-cache-store")
        with _STORES_LOCK:
            _STORES[:] = [t for t in _STORES if t.is_alive()] + [thread]
        thread.start()

    def _write(self, group: str, tensors: list[torch.Tensor]) -> None:
        desc = self._describe(group, [(tuple(t.shape), t.dtype) for t in tensors])
        final = self.directory / f"{group}.bin"
        tmp = final.with_name(f".{final.name}.{os.getpid()}.{threading.get_ident()}")
        try:
            with open(tmp, "wb") as f:
                f.write(_HEAD.pack(MAGIC, len(desc)) + desc)
                f.write(bytes(_data_start(len(desc)) - f.tell()))
                for t in tensors:
                    data = t.contiguous().view(torch.uint8).reshape(-1).numpy()
                    f.write(memoryview(data))
                    f.write(bytes(aligned(data.nbytes) - data.nbytes))
            os.replace(tmp, final)
        finally:
            tmp.unlink(missing_ok=True)

    def _drop_orphans(self) -> None:
        """Remove temporary files a store left behind when its process died mid-write (older than ORPHAN_S)."""
        now = time.time()
        for tmp in self.directory.glob(".*.bin.*"):
            try:
                if now - tmp.stat().st_mtime > ORPHAN_S:
                    tmp.unlink()
            except OSError:
                continue

    def _sweep(self) -> None:
        """Remove the entry directories whose source.json names a GGUF that no longer exists or is no longer the
        file their entries came from (anything else under the root is left alone)."""
        if not self.root.is_dir():
            return
        for d in self.root.iterdir():
            try:
                recorded = json.loads((d / "source.json").read_text())
                path = recorded["path"]
            except (OSError, ValueError, KeyError, TypeError):
                continue
            if not isinstance(path, str):
                continue
            try:
                stale = source_identity(path) != recorded
            except OSError:
                stale = True  # the GGUF is gone
            if stale:
                shutil.rmtree(d, ignore_errors=True)
