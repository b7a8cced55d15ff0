"""The NVMe tier of offload (ZeRO-Infinity style): host tensors kept in files under ``--nvme-dir``.

    with NvmeStore("/mnt/nvme", rank=r) as store:     # DIR/autopar-nvme-<pid>-<rank>-<random>/
        store.write("exp_avg.3", chunk)               # async; bytes copied at once, chunk reusable
        store.read("exp_avg.4", buf).result()         # async read into a CPU contiguous tensor
        store.read_now("exp_avg.4", buf)              # the same, waited for, nothing kept
        store.wait()                                  # all I/O done; first error as NvmeError

The optimizer streams its state chunk by chunk (read k+1 while k steps, write k back while k+1
steps). I/O runs on a thread pool with ``os.pwrite`` / ``os.preadv``, one file per key, padded to
``align`` bytes, overwritten in place. Per key, a read waits for the write before it and a write
for every earlier read and write.

O_DIRECT (``direct=True``) is used where a probe shows it works (ext4/xfs; not tmpfs or macOS, where
I/O silently stays buffered): this tier exists to keep state out of host RAM, which the page cache
would refill. Writes go from the padded aligned copy ``write`` makes anyway; reads land in ``out``
directly for its aligned head, the rest through a small bounce buffer. CPU tensors only (pinned or
not): the caller moves them to and from the GPU. The directory goes at ``close()``, on leaving a
``with`` block (exception or not), at garbage collection and at interpreter exit; a killed rank's
(pid dead, same host) goes when the next store is created under the same ``--nvme-dir``.
"""
from __future__ import annotations

import collections
import concurrent.futures as cf
import errno
import os
import re
import shutil
import socket
import tempfile
import threading
import weakref
from dataclasses import dataclass, field

import numpy as np
import torch

# No module-level mutable state. Cleanup at exit / collection goes through ``weakref.finalize``,
# whose registry (the standard library's) is the only process-wide state involved.
_STALE = re.compile(r"\.?autopar-nvme-(?:new-)?(\d+)-.+")
_OWNER = "owner"            # file in each store directory: the hostname that created it
_HINT = "pass --nvme-dir on a larger disk or drop nvme from --force offload="


class NvmeError(RuntimeError):
    """An NVMe-offload failure, with what to do about it (one line)."""


@dataclass
class _Entry:
    path: str
    dtype: torch.dtype
    numel: int
    nbytes: int                               # payload bytes
    padded: int                               # bytes in the file
    last_write: cf.Future | None = None
    pending: list = field(default_factory=list)   # this key's futures not known to be done


def _fmt(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit} ({n} bytes)"
    return f"{n} bytes"


def _space_error(directory: str, need: int, what: str, quota: bool = False) -> NvmeError:
    try:
        free = _fmt(shutil.disk_usage(directory).free)
    except OSError:
        free = "an unknown amount"
    return NvmeError(f"NVMe offload directory {directory} is "
                     f"{'over its disk quota' if quota else 'out of space'}: {what} needs "
                     f"{_fmt(need)} but {free} is free; {_HINT}")


def _io_error(exc: OSError, path: str, directory: str, need: int, what: str) -> NvmeError:
    quota = exc.errno == getattr(errno, "EDQUOT", None)
    if exc.errno == errno.ENOSPC or quota:
        return _space_error(directory, need, what, quota)
    text = os.strerror(exc.errno) if exc.errno else str(exc)
    return NvmeError(f"NVMe offload I/O failed {what} at {path}: [errno {exc.errno}] {text}")


def _aligned(nbytes: int, align: int) -> np.ndarray:
    """A uint8 buffer of ``nbytes`` whose address is a multiple of ``align`` (for O_DIRECT)."""
    raw = np.empty(nbytes + align, np.uint8)
    off = -raw.ctypes.data % align
    return raw[off:off + nbytes]


def _bytes_of(t: torch.Tensor) -> np.ndarray:
    """The bytes of a CPU contiguous tensor as a uint8 array sharing its memory (any dtype, 0-d too)."""
    return t.detach().reshape(-1).view(torch.uint8).numpy()


def _pwrite_all(fd: int, mv: memoryview, offset: int) -> None:
    while len(mv):
        n = os.pwrite(fd, mv, offset)
        if n <= 0:
            raise OSError(errno.EIO, "pwrite wrote nothing")
        mv, offset = mv[n:], offset + n


def _pread_all(fd: int, mv: memoryview, offset: int, path: str) -> None:
    while len(mv):
        n = os.preadv(fd, [mv], offset)
        if n <= 0:
            raise NvmeError(f"NVMe offload file {path} ends early (byte {offset}): something else "
                            "truncated it; leave --nvme-dir alone while a run uses it")
        mv, offset = mv[n:], offset + n


# The I/O tasks are module functions that never hold the store: a pending task must not keep it
# alive, or its last reference could drop on a pool thread, whose finalizer would join that thread.
# A task may block on earlier futures of its key; the pool's queue is FIFO, so each of those has
# been taken by a thread already (and waits only on still earlier ones): no deadlock.
def _do_write(deps, path, flags, buf, padded, directory, key) -> None:
    cf.wait(deps)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | flags, 0o600)
        try:
            _pwrite_all(fd, memoryview(buf), 0)
            if os.fstat(fd).st_size > padded:
                os.ftruncate(fd, padded)
        finally:
            os.close(fd)
    except OSError as exc:
        raise _io_error(exc, path, directory, padded, f"writing {key!r}") from exc


def _do_read(dep, path, flags, dst, nbytes, align, directory, key):
    if dep is not None:
        cf.wait([dep])
        exc = cf.CancelledError() if dep.cancelled() else dep.exception()
        if exc is not None:
            raise NvmeError(f"read of {key!r} from {directory} not done: the write before it "
                            f"failed ({exc})")
    try:
        fd = os.open(path, os.O_RDONLY | flags)
        try:
            if not flags:                           # buffered: straight into the tensor
                _pread_all(fd, memoryview(dst), 0, path)
            else:                                   # O_DIRECT: aligned head in place, rest bounced
                head = nbytes // align * align if dst.ctypes.data % align == 0 else 0
                _pread_all(fd, memoryview(dst[:head]), 0, path)
                if nbytes > head:
                    bounce = _aligned(-(-(nbytes - head) // align) * align, align)
                    _pread_all(fd, memoryview(bounce), head, path)
                    dst[head:] = bounce[:nbytes - head]
        finally:
            os.close(fd)
    except OSError as exc:
        raise _io_error(exc, path, directory, 0, f"reading {key!r}") from exc


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True                                 # someone else's, or not a pid: leave it be
    try:                                            # a killed rank not yet reaped is a zombie
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _remove_stale(parent: str) -> None:
    """Remove directories left by stores of dead processes on this host (a killed rank)."""
    try:
        names = os.listdir(parent)
    except OSError:
        return
    for name in names:
        m = _STALE.fullmatch(name)
        if m is None or _alive(int(m.group(1))):
            continue
        path = os.path.join(parent, name)
        try:                    # a shared --nvme-dir: another host's pids mean nothing here
            with open(os.path.join(path, _OWNER)) as f:
                ours = f.read().strip() == socket.gethostname()
        except OSError:
            ours = False
        if ours:
            shutil.rmtree(path, ignore_errors=True)


def _probe_direct(root: str, align: int) -> int:
    """``os.O_DIRECT`` if an aligned write and read-back with it work in ``root``, else 0."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return 0
    path = os.path.join(root, ".probe")
    buf, back = _aligned(align, align), _aligned(align, align)
    buf[:] = 0xA5
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | flag, 0o600)
        try:
            os.unlink(path)
            ok = os.pwrite(fd, buf, 0) == align and os.preadv(fd, [back], 0) == align
            return flag if ok and bool((back == 0xA5).all()) else 0
        finally:
            os.close(fd)
    except OSError:
        return 0


def _cleanup(pool: cf.ThreadPoolExecutor, root: str, pid: int) -> None:
    if os.getpid() != pid:
        return                  # a forked child exiting: the directory is its parent's
    pool.shutdown(wait=True, cancel_futures=True)
    shutil.rmtree(root, ignore_errors=True)


def _check_parent(parent: str) -> None:
    if not os.path.exists(parent):
        raise NvmeError(f"--nvme-dir {parent} does not exist; create it (mkdir -p {parent}) or pass "
                        "--nvme-dir with an existing directory on a local NVMe disk")
    if not os.path.isdir(parent):
        raise NvmeError(f"--nvme-dir {parent} is not a directory; pass --nvme-dir with a directory "
                        "on a local NVMe disk")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise NvmeError(f"--nvme-dir {parent} is not writable by this user; fix its permissions or "
                        "pass --nvme-dir with a directory you can write to")


class NvmeStore:
    """Tensors in files under ``directory`` (see the module's docstring). Calls may come from two
    threads (the training loop, and an offloaded optimizer step overlapping its forward,
    ``runtime/host_step.py``): the bookkeeping of entries and futures is under a lock, taken to
    record a call's dependencies and submit it in one go, so per key the pool still sees the calls
    in the order they were made; the pool's ``threads`` do the I/O."""

    def __init__(self, directory: str | os.PathLike, *, rank: int = 0, threads: int = 2,
                 align: int = 4096, direct: bool = True):
        if align <= 0 or align & (align - 1):
            raise ValueError(f"align must be a power of two, got {align}")
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self.directory = os.path.abspath(os.fspath(directory))
        _check_parent(self.directory)
        _remove_stale(self.directory)
        pid = os.getpid()
        try:        # made under a temporary name, renamed once its owner file is in
            tmp = tempfile.mkdtemp(prefix=f".autopar-nvme-new-{pid}-", dir=self.directory)
            with open(os.path.join(tmp, _OWNER), "w") as f:
                f.write(socket.gethostname() + "\n")
            root = os.path.join(self.directory, f"autopar-nvme-{pid}-{rank}-{tmp.rsplit('-', 1)[1]}")
            os.rename(tmp, root)
        except OSError as exc:
            raise _io_error(exc, self.directory, self.directory, 0, "creating a directory") from exc
        self.root, self.rank, self.align = root, rank, align
        self._pool = cf.ThreadPoolExecutor(threads, thread_name_prefix=f"autopar-nvme-{rank}")
        self._finalizer = weakref.finalize(self, _cleanup, self._pool, root, pid)
        self._flags = _probe_direct(root, align) if direct else 0
        self.direct = bool(self._flags)     # whether I/O bypasses the page cache (O_DIRECT)
        self._entries: dict[str, _Entry] = {}
        self._inflight: list[cf.Future] = []
        self._lock = threading.Lock()       # _entries, each entry's futures, _inflight
        self._closed = False

    def _host(self, t: torch.Tensor, verb: str) -> torch.Tensor:
        if self._closed:
            raise NvmeError(f"NvmeStore {self.root} is closed; create a new one")
        if t.device.type != "cpu" or t.layout != torch.strided:
            raise NvmeError(f"NvmeStore cannot {verb} a tensor on {t.device} ({t.layout}): it moves "
                            "dense host memory only; copy it to a CPU (pinned) tensor first")
        if not t.is_contiguous():
            raise NvmeError(f"NvmeStore cannot {verb} a non-contiguous tensor (shape "
                            f"{tuple(t.shape)}, strides {t.stride()}); pass a CPU contiguous tensor")
        return t

    def _submit(self, fn, *args) -> cf.Future:
        """``fn(*args)`` on the pool (the caller holds the lock)."""
        fut = self._pool.submit(fn, *args)
        self._inflight.append(fut)
        if len(self._inflight) > 256:       # keep the pending and the failed (wait() reports them)
            self._inflight = [f for f in self._inflight
                              if not f.done() or f.cancelled() or f.exception() is not None]
        return fut

    def free_bytes(self) -> int:
        """Bytes free (for this user) on the disk holding the store."""
        return shutil.disk_usage(self.directory).free

    def check_space(self, nbytes: int, what: str = "this write") -> None:
        """Raise NvmeError (with what to do) if the disk cannot hold ``nbytes`` more."""
        if nbytes > 0 and nbytes > self.free_bytes():
            raise _space_error(self.directory, nbytes, what)

    def write(self, key: str, tensor: torch.Tensor) -> cf.Future:
        """Write ``tensor`` (CPU, contiguous) under ``key``, asynchronously. Its bytes are copied
        before this returns: the caller may reuse the tensor at once. Future's result: None."""
        t = self._host(tensor, "write")
        nbytes = t.numel() * t.element_size()
        padded = -(-nbytes // self.align) * self.align
        buf = _aligned(padded, self.align)
        buf[:nbytes] = _bytes_of(t)
        buf[nbytes:] = 0
        with self._lock:
            e = self._entries.get(key)
            self.check_space(padded - (e.padded if e else 0), f"writing {key!r}")
            if e is None:
                path = os.path.join(self.root, f"{len(self._entries):06d}.bin")
                e = self._entries[key] = _Entry(path, t.dtype, t.numel(), nbytes, padded)
            else:
                e.dtype, e.numel, e.nbytes, e.padded = t.dtype, t.numel(), nbytes, padded
            deps = [f for f in e.pending if not f.done()]
            fut = self._submit(_do_write, deps, e.path, self._flags, buf, padded, self.directory, key)
            e.pending, e.last_write = deps + [fut], fut
        return fut

    def read(self, key: str, out: torch.Tensor) -> cf.Future:
        """Read ``key`` into ``out`` (CPU, contiguous, the numel and dtype written), asynchronously,
        after any write of ``key`` issued before. Future's result: None (a result would keep ``out``
        alive as long as the store keeps the future, until ``wait``)."""
        t = self._host(out, "read into")
        with self._lock:
            e = self._entries.get(key)
            if e is None:
                raise NvmeError(f"nothing was written under {key!r} in {self.root}; write it first")
            if t.dtype != e.dtype or t.numel() != e.numel:
                raise NvmeError(f"read of {key!r}: out holds {t.numel()} x {t.dtype} but {e.numel} x "
                                f"{e.dtype} were written; pass a tensor of the written numel and dtype")
            fut = self._submit(_do_read, e.last_write, e.path, self._flags, _bytes_of(t), e.nbytes,
                               self.align, self.directory, key)
            e.pending = [f for f in e.pending if not f.done()] + [fut]
        return fut

    def read_now(self, key: str, out: torch.Tensor) -> torch.Tensor:
        """``read`` waited for (its error raised here, NvmeError), dropped from the futures ``wait``
        reports; ``out``."""
        self.finish(key, self.read(key, out))
        return out

    def finish(self, key: str, fut: cf.Future) -> None:
        """Wait for ``fut``, a read of ``key`` (its error raised here, NvmeError), and drop it from
        the futures ``wait`` reports (a read started ahead, waited for when it is needed)."""
        try:
            fut.result()
        finally:
            with self._lock:
                self._inflight = [f for f in self._inflight if f is not fut]
                e = self._entries[key]
                e.pending = [f for f in e.pending if f is not fut]

    def nbytes(self) -> int:
        """Bytes held in files (padded sizes), counting writes issued but still pending."""
        with self._lock:
            return sum(e.padded for e in self._entries.values())

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def wait(self) -> None:
        """Wait for all pending I/O; raise the first failure (in issue order) as NvmeError."""
        with self._lock:
            pending, self._inflight = self._inflight, []
        cf.wait(pending)
        for f in pending:
            exc = None if f.cancelled() else f.exception()
            if isinstance(exc, NvmeError):
                raise exc
            if exc is not None:
                raise NvmeError(f"NVMe offload I/O in {self.root} failed: "
                                f"{type(exc).__name__}: {exc}") from exc

    def close(self) -> None:
        """Wait for pending I/O, remove the directory (even if that I/O failed: its error is raised
        after). Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self.wait()
        finally:
            self._finalizer()

    def __enter__(self) -> NvmeStore:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            self.close()
        except NvmeError:
            if exc_type is None:
                raise               # else the exception already leaving the block is the one to see


class BoundedWrites:
    """Writes to ``store`` with at most ``window`` bytes in flight: ``NvmeStore.write`` copies a
    tensor's bytes into a buffer of its own at once, held until its thread has written them, so a
    stream of writes faster than the disk would pile them up in host memory; beyond the window the
    oldest are waited for."""

    def __init__(self, store: NvmeStore, window: int) -> None:
        self.store, self.window = store, window
        self._writes: collections.deque = collections.deque()     # (future, bytes), oldest first
        self._in_flight = 0
        self.written = 0                                           # over the run: bytes written

    def write(self, key: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        self._writes.append((self.store.write(key, tensor), nbytes))
        self.written += nbytes
        self._in_flight += nbytes
        while self._in_flight > self.window and self._writes:
            fut, n = self._writes.popleft()
            fut.result()
            self._in_flight -= n

    def forget(self) -> None:
        """Stop counting the writes issued so far (a later read of a key waits for its write)."""
        self._writes.clear()
        self._in_flight = 0

