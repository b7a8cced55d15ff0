"""NvmeStore: tensors in files under --nvme-dir (autopar/runtime/nvme.py)."""
import errno
import gc
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from autopar.runtime import nvme
from autopar.runtime.nvme import NvmeError, NvmeStore

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _dirs(parent):
    return sorted(n for n in os.listdir(parent) if "autopar-nvme-" in n)


@pytest.fixture(params=[True, False], ids=["direct", "buffered"])
def direct(request):
    return request.param


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {
        "f32": torch.randn(3000, generator=g),                       # 12000 B: not a multiple of 4096
        "f32_2d": torch.randn(64, 64, generator=g),                  # exactly 4 pages
        "bf16": torch.randn(777, generator=g).to(torch.bfloat16),
        "i64": torch.randint(-2**40, 2**40, (513,), generator=g),
        "i8": torch.randint(-128, 127, (5,), dtype=torch.int8, generator=g),
        "bool": torch.rand(11, generator=g) > 0.5,
        "scalar": torch.tensor(3.25),
        "empty": torch.empty(0),
    }


def test_round_trip(tmp_path, direct):
    with NvmeStore(tmp_path, direct=direct) as s:
        if direct:
            assert s.direct                                      # /tmp is ext4 here
        ts = _tensors()
        for k, t in ts.items():
            s.write(k, t)
        outs = {k: torch.empty_like(t) for k, t in ts.items()}
        futs = [s.read(k, outs[k]) for k in ts]
        s.wait()
        assert all(f.result() is None for f in futs)
        for k, t in ts.items():
            assert torch.equal(outs[k], t), k
        assert "bf16" in s and "nope" not in s
        assert torch.equal(s.read_now("bf16", torch.empty_like(ts["bf16"])), ts["bf16"])


def test_a_done_read_keeps_no_buffer(tmp_path):
    """The store keeps its futures (``wait`` reports their errors) until ``wait``: a read's future
    holding ``out`` would keep every buffer read until then alive (the NVMe optimizer step read every
    chunk's state while only two chunks' buffers were meant to live; the parameter tier every row)."""
    import gc
    import weakref

    with NvmeStore(tmp_path) as s:
        s.write("k", torch.randn(1000))
        out = torch.empty(1000)
        s.read("k", out).result()
        gone = weakref.ref(out.untyped_storage())
        del out
        gc.collect()
        assert gone() is None, "the store still holds the read's buffer"


def test_read_into_unaligned_and_reshaped_out(tmp_path, direct):
    t = torch.randn(5000)
    with NvmeStore(tmp_path, direct=direct) as s:
        s.write("k", t).result()
        big = torch.zeros(5001)
        out = big[1:]                                            # address off by 4 bytes
        s.read("k", out).result()
        assert torch.equal(out, t) and big[0] == 0
        aligned = torch.from_numpy(nvme._aligned(20000, 4096)).view(torch.float32)
        s.read("k", aligned).result()                            # O_DIRECT: head in place, tail bounced
        assert torch.equal(aligned, t)
        out2 = torch.empty(50, 100)                              # same numel, other shape: fine
        s.read("k", out2).result()
        assert torch.equal(out2.reshape(-1), t)


def test_tmpfs_falls_back_silently():
    if not os.path.isdir("/dev/shm") or not os.access("/dev/shm", os.W_OK):
        pytest.skip("no writable /dev/shm")
    with NvmeStore("/dev/shm") as s:
        s.write("k", torch.arange(10.0))
        out = torch.empty(10)
        s.read("k", out).result()
        assert torch.equal(out, torch.arange(10.0))
        root = s.root
    assert not os.path.exists(root)


def test_tensor_reusable_after_write_and_overwrite_in_place(tmp_path):
    with NvmeStore(tmp_path) as s:
        t = torch.arange(1000, dtype=torch.float32)
        s.write("k", t)
        t.fill_(-1)                                              # bytes were copied at the call
        out = torch.empty(1000)
        s.read("k", out).result()
        assert torch.equal(out, torch.arange(1000, dtype=torch.float32))
        files = sorted(os.listdir(s.root))
        s.write("k", torch.ones(1000)).result()
        assert sorted(os.listdir(s.root)) == files               # same file, rewritten
        s.read("k", out).result()
        assert torch.equal(out, torch.ones(1000))
        s.write("k", torch.ones(10, dtype=torch.float64)).result()  # other size: the file shrinks
        small = torch.empty(10, dtype=torch.float64)
        s.read("k", small).result()
        assert torch.equal(small, torch.ones(10, dtype=torch.float64))
        assert s.nbytes() == 4096
        assert os.path.getsize(s._entries["k"].path) == 4096


def test_ordering_with_everything_pending(tmp_path, monkeypatch):
    real_pwrite, real_preadv = os.pwrite, os.preadv

    def slow_pwrite(*a):
        time.sleep(0.05)
        return real_pwrite(*a)

    def slow_preadv(*a):
        time.sleep(0.05)
        return real_preadv(*a)

    with NvmeStore(tmp_path, threads=4) as s:
        monkeypatch.setattr(os, "pwrite", slow_pwrite)
        a, b = torch.full((3000,), 1.0), torch.full((3000,), 2.0)
        out_a, out_b = torch.empty(3000), torch.empty(3000)
        w1 = s.write("k", a)
        r1 = s.read("k", out_a)                                  # after w1 (read-after-write)
        assert not w1.done() and not r1.done()
        s.write("k", b)
        s.read("k", out_b)
        s.wait()
        assert torch.equal(out_a, a) and torch.equal(out_b, b)

        monkeypatch.setattr(os, "pwrite", real_pwrite)
        monkeypatch.setattr(os, "preadv", slow_preadv)
        out_c = torch.empty(3000)
        r = s.read("k", out_c)
        s.write("k", a)                                          # must not overtake the read
        assert not r.done()
        s.wait()
        assert torch.equal(out_c, b)


def test_nbytes(tmp_path):
    with NvmeStore(tmp_path, align=4096) as s:
        assert s.nbytes() == 0
        s.write("a", torch.zeros(1))                             # 4 B -> one page
        s.write("b", torch.zeros(1025))                          # 4100 B -> two pages
        s.write("c", torch.zeros(1024))                          # 4096 B -> one page
        s.write("d", torch.tensor(1.0))                          # 0-d
        assert s.nbytes() == 5 * 4096
        s.wait()
        sizes = sum(os.path.getsize(e.path) for e in s._entries.values())
        assert sizes == s.nbytes()
    with NvmeStore(tmp_path, align=512, direct=False) as s:
        s.write("a", torch.zeros(129)).result()                  # 516 B -> 1024
        assert s.nbytes() == 1024


def test_close_removes_directory_and_is_idempotent(tmp_path):
    s = NvmeStore(tmp_path, rank=3)
    name = os.path.basename(s.root)
    assert name.startswith(f"autopar-nvme-{os.getpid()}-3-")
    assert _dirs(tmp_path) == [name]
    s.write("k", torch.randn(100))
    s.close()
    s.close()
    assert _dirs(tmp_path) == []
    with pytest.raises(NvmeError, match="closed"):
        s.write("k", torch.randn(100))


def test_with_block_removes_directory_on_exception(tmp_path):
    with pytest.raises(ZeroDivisionError):
        with NvmeStore(tmp_path) as s:
            s.write("k", torch.randn(100))
            root = s.root
            1 / 0
    assert not os.path.exists(root) and _dirs(tmp_path) == []


def test_garbage_collection_removes_directory(tmp_path):
    s = NvmeStore(tmp_path)
    s.write("k", torch.randn(100))
    root = s.root
    del s
    gc.collect()
    assert not os.path.exists(root)


def _run(script, parent, **kw):
    code = textwrap.dedent(f"""
        import os, signal, sys, torch
        from autopar.runtime.nvme import NvmeStore
        s = NvmeStore({str(parent)!r})
        s.write("k", torch.randn(1000)).result()
        print(s.root, flush=True)
    """) + textwrap.dedent(script)
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                           timeout=120, **kw)


def test_subprocess_normal_exit_and_error_exit_remove_directory(tmp_path):
    p = _run("s.write('j', torch.randn(10))\n", tmp_path)       # exits with a write pending
    assert p.returncode == 0, p.stderr
    root = p.stdout.strip()
    assert root.startswith(str(tmp_path)) and not os.path.exists(root)
    p = _run("raise SystemError('boom')\n", tmp_path)
    assert p.returncode == 1 and "boom" in p.stderr
    assert not os.path.exists(p.stdout.strip()) and _dirs(tmp_path) == []


def test_killed_process_directory_removed_by_next_store(tmp_path):
    p = _run("os.kill(os.getpid(), signal.SIGKILL)\n", tmp_path)
    assert p.returncode == -signal.SIGKILL
    root = p.stdout.strip()
    assert os.path.isdir(root)                                   # nothing ran at the kill
    other_host = tmp_path / "autopar-nvme-999999999-0-xyz"      # a dead pid, another host's dir
    other_host.mkdir()
    (other_host / "owner").write_text("some-other-host\n")
    with NvmeStore(tmp_path) as s:
        assert not os.path.exists(root)
        assert other_host.is_dir()                               # not this host's: left alone
        assert os.path.basename(s.root) in _dirs(tmp_path)


def test_bad_directories(tmp_path):
    with pytest.raises(NvmeError, match=r"does not exist.*--nvme-dir"):
        NvmeStore(tmp_path / "missing")
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(NvmeError, match="is not a directory"):
        NvmeStore(f)


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write anywhere")
def test_unwritable_directory(tmp_path):
    d = tmp_path / "ro"
    d.mkdir(mode=0o500)
    with pytest.raises(NvmeError, match="not writable"):
        NvmeStore(d)


def test_enospc_is_a_clear_error(tmp_path, monkeypatch):
    def full(*a):
        raise OSError(errno.ENOSPC, "No space left on device")

    s = NvmeStore(tmp_path)
    monkeypatch.setattr(os, "pwrite", full)
    fut = s.write("exp_avg", torch.randn(2000))
    with pytest.raises(NvmeError, match=r"out of space.*8192 bytes.*--nvme-dir.*offload=") as ei:
        fut.result()
    assert str(tmp_path) in str(ei.value) and "free" in str(ei.value)
    out = torch.empty(2000)
    r = s.read("exp_avg", out)                                   # chained after the failed write
    with pytest.raises(NvmeError, match="write before it failed"):
        r.result()
    with pytest.raises(NvmeError, match="--nvme-dir"):
        s.wait()
    s.wait()                                                     # reported once
    monkeypatch.setattr(os, "pwrite", lambda *a: (_ for _ in ()).throw(OSError(errno.EIO, "x")))
    s.write("k", torch.randn(10))
    with pytest.raises(NvmeError, match=r"writing 'k' at .*Input/output error"):
        s.close()
    assert not os.path.exists(s.root)                            # removed even so


def test_check_space(tmp_path, monkeypatch):
    with NvmeStore(tmp_path) as s:
        free = s.free_bytes()
        assert free > 0
        s.check_space(1)
        with pytest.raises(NvmeError, match=r"out of space.*--nvme-dir"):
            s.check_space(free + (1 << 40))

        class Usage:
            free = 100
        monkeypatch.setattr(nvme.shutil, "disk_usage", lambda p: Usage)
        with pytest.raises(NvmeError, match=r"writing 'big' needs 4.00 KiB.*100 bytes is free"):
            s.write("big", torch.zeros(1000))                   # refused before any I/O
        assert "big" not in s and s.nbytes() == 0


def test_read_errors(tmp_path):
    with NvmeStore(tmp_path) as s:
        s.write("k", torch.zeros(100))
        with pytest.raises(NvmeError, match=r"100 x torch.float32 were written"):
            s.read("k", torch.empty(99))
        with pytest.raises(NvmeError, match=r"torch.float64"):
            s.read("k", torch.empty(100, dtype=torch.float64))
        with pytest.raises(NvmeError, match="nothing was written under 'nope'"):
            s.read("nope", torch.empty(100))
        with pytest.raises(NvmeError, match="non-contiguous"):
            s.read("k", torch.empty(20, 10)[:, :5])
        with pytest.raises(NvmeError, match="non-contiguous"):
            s.write("nc", torch.empty(10, 10).t())
        with pytest.raises(NvmeError, match="on meta"):
            s.write("m", torch.empty(4, device="meta"))


def test_rows_read_ahead_and_dropped_when_the_masters_change(tmp_path):
    """``NvmeRows`` (offload nvme_params): a read started ahead is what the gather gets; one started
    for a gather that never came is dropped when the rows change (the optimizer step rewrites the
    masters), so the next gather reads the new rows, not the stale ones read ahead."""
    from types import SimpleNamespace

    from autopar.runtime.nvme_rows import NvmeRows

    with NvmeStore(tmp_path) as store:
        slot = SimpleNamespace(name="w", local=torch.nn.Parameter(torch.zeros(4, 3)))
        store.write("w/master", torch.ones(4, 3))
        rows = NvmeRows(store, [slot], torch.device("cpu"))
        rows.release()
        assert slot.local.untyped_storage().nbytes() == 0
        # (the released parameter's data must not be printed: kept out of the assertions)
        assert len(rows.ahead([slot])) == 1 and rows.ahead([slot]) == []     # once per gather
        got = rows.rows(slot)
        assert torch.equal(got, torch.ones(4, 3)) and (rows.reads, rows.read_ahead) == (1, 1)
        rows.ahead([slot])                                  # for a gather that does not come
        store.write("w/master", torch.full((4, 3), 2.0))   # the step's updated master
        rows.drop_ahead()
        got = rows.rows(slot)
        assert torch.equal(got, torch.full((4, 3), 2.0)) and (rows.reads, rows.read_ahead) == (2, 1)
        rows.ahead_enabled = False                          # every read on the spot
        assert rows.ahead([slot]) == []
        got = rows.rows(slot)
        assert torch.equal(got, torch.full((4, 3), 2.0))
        store.wait()


def test_masters_stream_to_their_files_as_they_are_made(tmp_path, monkeypatch):
    """``HostOptimizer`` with the NVMe tier: each master goes to its file as it is made and leaves
    host memory (with nvme_params the rows it was made from too, the file being the rows): at
    each write one master is in host memory, not all of them (a 2-3B-parameter run of
    ``benchmarks/largest_model.py --nvme-gb 40`` was killed for memory while they were all made
    first), and the rows not reached yet."""
    from types import SimpleNamespace

    from autopar.runtime.offload import HostOptimizer

    slots = [SimpleNamespace(name=f"w{i}", plan=SimpleNamespace(shape=(64, 8)),
                             local=torch.nn.Parameter(torch.full((64, 8), float(i)))) for i in range(6)]
    for s in slots:
        s.opt_param = s.local
    ctx = SimpleNamespace(host_params=True, zero_stage=3, dp=1, nvme_rows=None, grad_files=None, host_step=None)
    seen, real = [], NvmeStore.write

    def write(self, key, t):       # the masters made before this one, still in host memory; this one; the rows
        seen.append((sum(s.host.numel() for s in slots if hasattr(s, "host")), t.numel(),
                     sum(s.local.untyped_storage().nbytes() for s in slots)))
        return real(self, key, t)

    monkeypatch.setattr(NvmeStore, "write", write)
    host = HostOptimizer(SimpleNamespace(slots=slots, ctx=ctx), lambda ps: torch.optim.SGD(ps, lr=0.1),
                         ("optimizer", "params", "nvme", "nvme_params"), torch.device("cpu"), nvme_dir=str(tmp_path))
    try:
        assert [(before, this) for before, this, _ in seen] == [(0, 64 * 8)] * 6
        assert [rows for _, _, rows in seen] == [(6 - i) * 64 * 8 * 4 for i in range(6)]
        assert all(s.host.numel() == 0 and s.local.untyped_storage().nbytes() == 0 for s in slots)
        assert torch.equal(host.rows.rows(slots[3]), torch.full((64, 8), 3.0))      # the files are the rows
    finally:
        host.close()


def test_rows_go_to_the_files_as_the_store_makes_them(tmp_path, monkeypatch):
    """``RowsToFiles`` (``ParamStore.build``'s sink with nvme_params): each parameter's rows are written
    as its master's file and dropped as the store makes them, so the rows are never all in host
    memory either; ``HostOptimizer`` writes no master again and reads them back as made."""
    from types import SimpleNamespace

    from autopar.runtime.nvme_rows import RowsToFiles
    from autopar.runtime.offload import HostOptimizer

    sink = RowsToFiles(str(tmp_path), 0, window=1024)
    slots, held = [], []
    for i in range(4):                                  # as ParamStore.build makes them, bf16 rows
        s = SimpleNamespace(name=f"w{i}", plan=SimpleNamespace(shape=(16, 8)),
                            local=torch.nn.Parameter(torch.full((16, 8), float(i), dtype=torch.bfloat16)))
        s.opt_param = s.local
        slots.append(s)
        sink(s)
        held.append(sum(x.local.untyped_storage().nbytes() for x in slots))
    assert held == [0] * 4 and sink.written == {"w0", "w1", "w2", "w3"}
    writes, real = [], NvmeStore.write
    monkeypatch.setattr(NvmeStore, "write", lambda self, key, t: writes.append(key) or real(self, key, t))
    ctx = SimpleNamespace(host_params=True, zero_stage=3, dp=1, nvme_rows=None, grad_files=None, host_step=None)
    host = HostOptimizer(SimpleNamespace(slots=slots, ctx=ctx), lambda ps: torch.optim.SGD(ps, lr=0.1),
                         ("optimizer", "params", "nvme", "nvme_params"), torch.device("cpu"), nvme_dir=str(tmp_path),
                         rows_in_files=sink)
    try:
        assert writes == [] and host.nvme is sink.store
        got = host.rows.rows(slots[2])
        assert got.dtype == torch.bfloat16 and torch.equal(got, torch.full((16, 8), 2.0, dtype=torch.bfloat16))
    finally:
        host.close()
