"""Tier primitives: DiskReader (O_DIRECT and tmpfs reads, row gathers), aligned buffers, PinnedPool, GpuSlots."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

from strata.errors import CheckpointError, StrataError, UnsupportedError
from strata.tiers.stats import PathCounters
from strata.tiers.storage import native_io
from strata.tiers.storage.diskio import ALIGN, DiskReader, aligned_empty
from strata.tiers.storage.gds import GpuDirectReader
from strata.tiers.storage.gpu_slots import GpuSlots
from strata.tiers.storage.pinned import PinnedPool

FILE_BYTES = 4 * 2**20 + 1234  # an unaligned tail: the last block is partial


def _write(path: Path, nbytes: int = FILE_BYTES, seed: int = 0) -> np.ndarray:
    data = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
    data.tofile(path)
    return data


@pytest.fixture(params=["disk", "tmpfs"])
def store_file(request, tmp_path) -> tuple[Path, np.ndarray]:
    """A random file on the real disk (tmp_path) or on tmpfs (/dev/shm; skipped where absent)."""
    if request.param == "disk":
        path = tmp_path / "store.bin"
    else:
        if not os.access("/dev/shm", os.W_OK):
            pytest.skip("no writable /dev/shm")
        path = Path("/dev/shm") / f"strata-test-{uuid.uuid4().hex}.bin"
    data = _write(path)
    yield path, data
    path.unlink(missing_ok=True)


@pytest.fixture(params=["native-aio", "native-threads", "python"])
def reader(request, monkeypatch):
    """A reader whose row gathers read their runs natively (strata.tiers.storage.native_io, built here with the system
    compiler: all submitted at once through Linux AIO on O_DIRECT files, or one C loop per thread) or from
    Python (the fallback without a compiler)."""
    if request.param.startswith("native"):
        if not native_io.available():
            pytest.skip("no C++ compiler for the native reads")
    else:
        monkeypatch.setattr(native_io, "available", lambda: False)
    r = DiskReader(num_threads=4, chunk_bytes=64 * 1024)  # small chunks: big reads fan out over the pool
    r.aio = request.param == "native-aio"
    yield r
    r.close()


@pytest.mark.parametrize("nbytes", [0, 1, 4096, 1_000_003])
def test_aligned_empty(nbytes):
    t = aligned_empty(nbytes)
    assert t.dtype == torch.uint8 and t.numel() == nbytes and t.is_contiguous()
    assert t.data_ptr() % ALIGN == 0 or nbytes == 0


def test_reads_equal_file_bytes(store_file, reader):
    path, data = store_file
    slot = 256 * 1024
    outs = [aligned_empty(slot) for _ in range(len(data) // slot)]
    futs = reader.read_many([(path, k * slot, slot, out) for k, out in enumerate(outs)])
    for k, (fut, out) in enumerate(zip(futs, outs, strict=True)):
        assert fut.result() is out
        assert np.array_equal(out.numpy(), data[k * slot : (k + 1) * slot])
    big = aligned_empty(3 * 2**20)  # > chunk_bytes: fanned out
    reader.read(path, 4096, big.numel(), big).result()
    assert np.array_equal(big.numpy(), data[4096 : 4096 + big.numel()])
    if path.parent == Path("/dev/shm"):
        assert reader.file(path).memory and not reader.file(path).direct


def test_unaligned_read_and_tail(store_file, reader):
    path, data = store_file
    out = torch.empty(5000, dtype=torch.uint8)  # buffer, offset and length all unaligned
    reader.read(path, 7, 4999, out).result()
    assert np.array_equal(out[:4999].numpy(), data[7:5006])
    tail = aligned_empty(8192)
    reader.read(path, len(data) - 1234, 1234, tail).result()  # the partial last block
    assert np.array_equal(tail[:1234].numpy(), data[-1234:])


def test_many_concurrent_reads(store_file):
    path, data = store_file
    rng = np.random.default_rng(1)
    with DiskReader(num_threads=8) as r:
        offs = (rng.integers(0, len(data) // ALIGN - 4, 300) * ALIGN).tolist()
        outs = [aligned_empty(4 * ALIGN) for _ in offs]
        futs = r.read_many([(path, o, 4 * ALIGN, out) for o, out in zip(offs, outs, strict=True)])
        for o, fut in zip(offs, futs, strict=True):
            assert np.array_equal(fut.result().numpy(), data[o : o + 4 * ALIGN])


@pytest.mark.parametrize("row_bytes,base", [(256, 0), (1024, 4096), (4096, 0), (1000, 123), (5000, 77), (4096, 100)])
def test_read_rows_match_numpy(store_file, reader, row_bytes, base):
    path, data = store_file
    nrows = (len(data) - base) // row_bytes
    table = data[base : base + nrows * row_bytes].reshape(nrows, row_bytes)
    rng = np.random.default_rng(row_bytes)
    rows = rng.integers(0, nrows, 700)
    rows[:50] = rows[50:100]  # duplicates
    rows[100:110] = np.arange(nrows - 10, nrows)  # the table's end (the partial last block)
    rows[110:120] = np.arange(10)  # consecutive rows: coalesced into runs
    rows[120:200] = np.arange(200, 280) % nrows  # a run of over 16 blocks (the reader's 64 KiB chunk): cut in pieces
    out = torch.empty(len(rows), row_bytes, dtype=torch.uint8)
    assert reader.read_rows(path, base, row_bytes, rows.tolist(), out).result() is out
    assert np.array_equal(out.numpy(), table[rows])
    small = torch.empty(3, row_bytes, dtype=torch.uint8)  # a tensor of indices works too
    reader.read_rows(path, base, row_bytes, torch.tensor([5, 0, 5]), small).result()
    assert np.array_equal(small.numpy(), table[[5, 0, 5]])
    assert reader.read_rows(path, base, row_bytes, [], torch.empty(0, dtype=torch.uint8)).result().numel() == 0


def test_aio_reads_equal_threaded_reads(tmp_path):
    """The native reads through Linux AIO (all of a batch in flight from one thread) return the same bytes as
    the threaded ones, the file's short last block included, and report a run past the end like them."""
    if not native_io.available():
        pytest.skip("no C++ compiler for the native reads")
    path = tmp_path / "aio.bin"
    data = _write(path, 300 * ALIGN + 1234)
    flags = os.O_RDONLY | getattr(os, "O_DIRECT", 0)
    try:
        fd = os.open(path, flags)
    except OSError:
        pytest.skip("no O_DIRECT on this filesystem")
    try:
        rng = np.random.default_rng(5)
        blocks = np.unique(np.concatenate([rng.integers(0, 300, 40), [300]]))  # block 300 is the short last one
        off, length = blocks * ALIGN, np.full(blocks.size, ALIGN)
        need = np.minimum(length, len(data) - off)
        bufs = {}
        for aio in (True, False):
            buf = aligned_empty(blocks.size * ALIGN).numpy()
            native_io.read_runs(fd, off, length, need, buf, np.arange(blocks.size) * ALIGN, threads=4, aio=aio)
            bufs[aio] = buf
        assert np.array_equal(bufs[True], bufs[False])
        for j, b in enumerate(blocks):
            n = int(need[j])
            assert np.array_equal(bufs[True][j * ALIGN : j * ALIGN + n], data[b * ALIGN : b * ALIGN + n])
        with pytest.raises(EOFError):  # a run that needs bytes past the end
            native_io.read_runs(fd, np.array([0, 301 * ALIGN]), np.full(2, ALIGN), np.full(2, ALIGN),
                                aligned_empty(2 * ALIGN).numpy(), np.array([0, ALIGN]), aio=True)
    finally:
        os.close(fd)


def test_rows_straddling_blocks(tmp_path, reader):
    data = _write(tmp_path / "t.bin", 64 * 1024)
    rows = np.array([0, 1, 2, 3, 5, 7, 3])  # with row_bytes 3000 at base 4000 most rows cross a 4 KiB boundary
    out = torch.empty(len(rows), 3000, dtype=torch.uint8)
    reader.read_rows(tmp_path / "t.bin", 4000, 3000, rows, out).result()
    assert np.array_equal(out.numpy(), data[4000 : 4000 + 8 * 3000].reshape(8, 3000)[rows])


def test_errors_name_the_file(tmp_path, reader):
    path = tmp_path / "short.bin"
    _write(path, 3 * ALIGN)
    out = aligned_empty(4 * ALIGN)
    with pytest.raises(CheckpointError, match="short.bin"):
        reader.read(path, 0, 4 * ALIGN, out).result()
    with pytest.raises(CheckpointError, match="short.bin"):
        reader.read_rows(path, 0, 1024, [11, 12], torch.empty(2, 1024, dtype=torch.uint8)).result()
    with pytest.raises(CheckpointError, match="missing.bin"):
        reader.read(tmp_path / "missing.bin", 0, ALIGN, out).result()
    reader.read(path, 0, ALIGN, out).result()  # opened, size cached: now truncate it behind the reader's back
    os.truncate(path, ALIGN)
    with pytest.raises(CheckpointError, match="short.bin.*(ended early|truncated)"):
        reader.read(path, ALIGN, 2 * ALIGN, out).result()
    with pytest.raises(ValueError):
        reader.read(path, 0, ALIGN, torch.empty(ALIGN, dtype=torch.float32))
    msg = str(pytest.raises(CheckpointError, reader.read(path, 0, 4 * ALIGN, out).result).value)
    assert "\n" not in msg


def test_pinned_pool_slots():
    pool = PinnedPool(3 * ALIGN, 10, pin=False, slab_bytes=4 * 3 * ALIGN)  # 4 slots per slab: 3 slabs
    assert pool.wait_ready(timeout=30) and pool.ready_slots() == 10
    assert pool.nbytes == 30 * ALIGN and not pool.pinned
    slots = [pool.slot(i) for i in range(10)]
    ptrs = [s.data_ptr() for s in slots]
    assert all(p % ALIGN == 0 for p in ptrs) and len(set(ptrs)) == 10
    for i, s in enumerate(slots):
        assert s.numel() == 3 * ALIGN and s.dtype == torch.uint8
        s.fill_(i)
    for i, s in enumerate(slots):  # disjoint: no write landed in another slot
        assert bool((s == i).all())
    with pytest.raises(IndexError):
        pool.slot(10)
    pool.close()


def _anon_huge_kib(address: int) -> int:
    """AnonHugePages (KiB) of the mapping of this process that holds `address`."""
    lines, hit = Path("/proc/self/smaps").read_text().splitlines(), False
    for line in lines:
        if "-" in line.split(" ", 1)[0] and not line.startswith(("AnonHuge", "Size")):
            lo, hi = (int(v, 16) for v in line.split(" ", 1)[0].split("-"))
            hit = lo <= address < hi
        elif hit and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


@pytest.mark.skipif(not Path("/sys/kernel/mm/transparent_hugepage/enabled").exists()
                    or "[never]" in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text(),
                    reason="no transparent huge pages on this system")
def test_unpinned_slabs_are_in_huge_pages():
    """A CPU host's slabs (the CPU kernel streams whole experts from them) ask for 2 MiB pages before they are
    touched, so they get them in THP's `madvise` mode too, and arrive zeroed (faulted in at allocation)."""
    pool = PinnedPool(1 << 20, 16, pin=False, slab_bytes=16 << 20, background=False)
    slot = pool.slot(0)
    assert bool((slot == 0).all())
    assert _anon_huge_kib(slot.data_ptr()) >= 2048
    pool.close()


def test_pinned_pool_background_and_errors():
    pool = PinnedPool(ALIGN, 64, pin=False, slab_bytes=16 * ALIGN, background=True)
    assert pool.slot(63).numel() == ALIGN  # waits for the last slab
    assert pool.ready_slots() == 64
    pool.close()
    sync = PinnedPool(ALIGN, 5, pin=False, background=False)
    assert sync.ready_slots() == 5
    sync.close()
    with pytest.raises(ValueError):
        PinnedPool(1000, 4, pin=False)
    if not torch.cuda.is_available():
        with pytest.raises(UnsupportedError):
            PinnedPool(ALIGN, 4, pin=True)
        assert not PinnedPool(ALIGN, 1).pinned  # pin=None: pinned iff CUDA


def test_pinned_pool_allocation_failure(monkeypatch):
    import strata.tiers.storage.pinned as pinned

    def boom(nbytes, pin):
        raise MemoryError("no room")

    monkeypatch.setattr(pinned, "_Slab", boom)
    pool = PinnedPool(ALIGN, 4, pin=False)
    with pytest.raises(StrataError, match="no room"):
        pool.slot(0)
    with pytest.raises(StrataError):
        pool.wait_ready(5)
    pool.close()


def test_gpu_slots_bookkeeping_cpu():
    g = GpuSlots(ALIGN, 4, num_layers=3, num_experts=8, device="cpu")
    assert g.copy_stream is None and bool((g.slot_of == -1).all()) and (g.slot_of_host == -1).all()
    g.assign((1, 5), 2)
    g.assign((2, 0), 0)
    assert g.slot_of[1, 5].item() == 2 and g.slot_for((1, 5)) == 2 and g.owner(2) == (1, 5)
    assert g.free_slots().tolist() == [1, 3] and g.num_resident == 2
    with pytest.raises(ValueError):
        g.assign((0, 0), 2)  # slot taken
    with pytest.raises(ValueError):
        g.assign((1, 5), 3)  # already resident elsewhere
    with pytest.raises(IndexError):
        g.assign((3, 0), 1)
    assert g.clear((1, 5)) == 2 and g.clear((1, 5)) == -1
    assert g.slot_of[1, 5].item() == -1 and g.owner(2) is None
    g.assign_many([(0, 1), (0, 2)], [1, 3])
    assert np.array_equal(g.slot_of.numpy(), g.slot_of_host)
    src = torch.arange(ALIGN, dtype=torch.int64).to(torch.uint8)
    assert g.load((2, 7), 2, src) is None
    assert torch.equal(g.view(2), src) and g.slot_for((2, 7)) == 2
    assert np.array_equal(g.slot_of.numpy(), g.slot_of_host)


def test_gpu_direct_reader_needs_kvikio():
    import importlib.util

    if importlib.util.find_spec("kvikio") is not None:
        pytest.skip("kvikio installed")
    assert not GpuDirectReader.available()
    with pytest.raises(UnsupportedError, match="kvikio"):
        GpuDirectReader()


# -- GPU (skipped without CUDA) ----------------------------------------------------------------------
@pytest.mark.gpu
def test_pinned_pool_is_pinned():
    pool = PinnedPool(2**20, 6, slab_bytes=4 * 2**20)
    assert pool.pinned and pool.wait_ready(60)
    assert all(pool.slot(i).is_pinned() and pool.slot(i).data_ptr() % ALIGN == 0 for i in range(6))
    pool.close()
    assert aligned_empty(ALIGN * 3, pin=True).is_pinned()


@pytest.mark.gpu
def test_copy_in_and_device_map(tmp_path):
    slot_bytes = 2**20
    data = _write(tmp_path / "experts.bin", 8 * slot_bytes)
    pool = PinnedPool(slot_bytes, 8, slab_bytes=4 * slot_bytes)
    g = GpuSlots(slot_bytes, 5, num_layers=2, num_experts=8, device="cuda")
    with DiskReader() as r:  # disk -> pinned slot (O_DIRECT) -> GPU slot
        for f in r.read_many([(tmp_path / "experts.bin", e * slot_bytes, slot_bytes, pool.slot(e)) for e in range(8)]):
            f.result()
    events = [g.load((1, e), e, pool.slot(e)) for e in range(4)]
    g.clear((1, 2))
    ev = torch.cuda.Event()
    ev.record()  # after the (notional) last reader of slot 2's old expert
    events.append(g.load((0, 7), 2, pool.slot(7), wait_for=ev))
    for e in events:
        torch.cuda.current_stream().wait_event(e)
    expect = {0: 0, 1: 1, 2: 7, 3: 3}
    for slot, e in expect.items():
        assert np.array_equal(g.view(slot).cpu().numpy(), data[e * slot_bytes : (e + 1) * slot_bytes])
    torch.cuda.synchronize()
    assert np.array_equal(g.slot_of.cpu().numpy(), g.slot_of_host)
    assert g.slot_of[0, 7].item() == 2 and g.slot_of[1, 2].item() == -1
    with pytest.raises(ValueError):
        g.copy_in(4, torch.zeros(16, dtype=torch.uint8))  # pageable: would be a silent synchronous copy
    g.assign_many([(0, 0)], [4])
    torch.cuda.synchronize()
    assert np.array_equal(g.slot_of.cpu().numpy(), g.slot_of_host)
    pool.close()


@pytest.mark.gpu
def test_gpu_direct_reader(tmp_path):
    if not GpuDirectReader.available():
        pytest.skip("kvikio not installed")
    data = _write(tmp_path / "k.bin", 2**20)
    r = GpuDirectReader()
    out = torch.empty(2**19, dtype=torch.uint8, device="cuda")
    r.read(tmp_path / "k.bin", ALIGN, 2**19, out).result()
    assert np.array_equal(out.cpu().numpy(), data[ALIGN : ALIGN + 2**19])
    with pytest.raises(CheckpointError, match="k.bin"):
        r.read(tmp_path / "k.bin", 2**20, 2**19, out)
    r.close()


def test_native_reads_fall_back_to_python_without_a_compiler(monkeypatch, tmp_path, caplog):
    """No C++ compiler: one warning, `available()` is False, and row gathers still read right (from Python)."""
    monkeypatch.setattr(native_io, "_lib", None)
    monkeypatch.setattr(native_io, "_tried", False)
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("STRATA_CACHE", str(tmp_path / "cache"))  # nothing built earlier is found
    with caplog.at_level("WARNING", logger="strata.tiers.storage.native_io"):
        assert not native_io.available()
    assert any("native disk reads unavailable" in r.message for r in caplog.records)
    data = _write(tmp_path / "t.bin", 64 * 1024)
    with DiskReader(num_threads=2) as r:
        out = torch.empty(3, 512, dtype=torch.uint8)
        r.read_rows(tmp_path / "t.bin", 0, 512, [7, 0, 99], out).result()
    assert np.array_equal(out.numpy(), data.reshape(-1, 512)[[7, 0, 99]])


def test_path_busy_time_counts_overlapping_transfers_once():
    """Batches that several threads enqueued on one copy stream have nested spans: the link was busy for their
    union, not their sum (summing charged a 55 GB/s link at ~20 GB/s, and the cost model stopped copying)."""
    p, gb = PathCounters(), 10**9
    p.add_interval(gb, 0.0, 2.0)
    p.add_interval(gb, 1.0, 2.0)  # inside the first: no extra busy time
    p.add_interval(gb, 1.5, 3.0)  # overlaps its end: 1 s more
    p.add_interval(gb, 5.0, 6.0)  # after an idle gap: the gap is not busy
    assert (p.bytes, p.objects) == (4 * gb, 4)
    assert p.seconds == pytest.approx(4.0)
    assert p.as_dict()["GB_per_s"] == pytest.approx(1.0)


def test_an_interrupt_during_a_tmpfs_row_gather_reaches_the_caller(monkeypatch, store_file):
    """A row gather from tmpfs runs on the calling thread: Ctrl+C there stops the caller (a program that never waits on
    the future, e.g. a prefetch, would otherwise go on as if not interrupted), while an error still goes to the
    future."""
    from strata.tiers.storage import diskio

    path, _ = store_file
    with DiskReader(num_threads=2) as r:
        if not r.file(path).memory:
            pytest.skip("a disk file's rows are read on the reader's threads")

        def interrupted(*args):
            raise KeyboardInterrupt

        monkeypatch.setattr(diskio, "gather_rows", interrupted)
        with pytest.raises(KeyboardInterrupt):
            r.read_rows(path, 0, 512, [1, 2], torch.empty(2, 512, dtype=torch.uint8))
        monkeypatch.setattr(diskio, "gather_rows", lambda *a: (_ for _ in ()).throw(OSError("bad row")))
        with pytest.raises(OSError, match="bad row"):
            r.read_rows(path, 0, 512, [1, 2], torch.empty(2, 512, dtype=torch.uint8)).result()
