"""Pinning the CPU expert kernel's threads to cores of their own ($STRATA_CPU_PIN=1, `numa.pin_expert_threads`):
the pool's workers and the thread that runs share 0 (the mailbox worker, `cpu_experts.pin_caller`) on the kernel's
CPUs, every other thread of the process on the rest. Each test runs in a fresh interpreter: affinity is per thread
and inherited, so changing it here would leak into the rest of the suite."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from strata.kernels import cpu_experts as ce

ROOT = Path(__file__).resolve().parent.parent
needs_two_cpus = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two usable CPUs")


def _run(code: str) -> dict:
    """Run `code` in a fresh interpreter; it prints one JSON line last."""
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300,
                         cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@needs_two_cpus
def test_the_kernel_gets_the_last_cpus_and_every_other_thread_the_rest():
    r = _run("""
        import json, os, threading
        from strata.runtime.numa import pin_expert_threads
        usable = sorted(os.sched_getaffinity(0))
        seen = {}
        waiting = threading.Event()
        t = threading.Thread(target=waiting.wait)  # a thread started before: confined too
        t.start()
        got = pin_expert_threads(1, configure=lambda cpus: seen.setdefault("cpus", cpus))
        before = sorted(os.sched_getaffinity(t.native_id))
        waiting.set(); t.join()
        later = []
        u = threading.Thread(target=lambda: later.extend(sorted(os.sched_getaffinity(0))))  # started after: inherits
        u.start(); u.join()
        too_many = pin_expert_threads(len(usable), configure=lambda cpus: seen.setdefault("twice", cpus))
        print(json.dumps({"usable": usable, "got": got, "seen": seen, "main": sorted(os.sched_getaffinity(0)),
                          "before": before, "later": later, "too_many": too_many}))
    """)
    kernel, others = r["got"]
    assert kernel == r["usable"][-1:] and others == r["usable"][:-1]
    assert r["seen"] == {"cpus": kernel}  # the pool told once; the refused second call changed nothing
    assert r["main"] == r["before"] == r["later"] == others
    assert r["too_many"] is None


@needs_two_cpus
@pytest.mark.skipif(ce.backend() == "torch", reason="needs the compiled CPU expert kernel")
def test_the_mailbox_worker_and_a_caller_take_the_pools_first_cpu():
    """With the pool pinned, the mailbox worker pins itself to the pool's first CPU (it runs the kernel's share 0)
    and still answers; `pin_caller` does the same for any thread, and does nothing once the pool is unpinned."""
    r = _run("""
        import json, os, threading
        import numpy as np, torch
        from strata.kernels import cpu_experts as ce
        from strata.runtime.cpu_mailbox import CpuMailbox
        usable = sorted(os.sched_getaffinity(0))
        cpu = usable[-1]
        ce.configure(cpus=[cpu])
        slab = torch.zeros(8, 3 * 64 * 32 * 2, dtype=torch.uint8)
        addr = np.array([[slab[e].data_ptr() for e in range(8)]], dtype=np.int64)
        before = {int(t) for t in os.listdir("/proc/self/task")}
        box = CpuMailbox([0], addr, hidden=64, inter=32, gu_bytes=2 * 32 * 64 * 2, payload=3 * 32 * 64 * 2, top_k=2,
                         max_tokens=1, threads=2, device=torch.device("cpu"))
        ok = box.self_test() is None  # (it computes no expert: the pool starts with the first cold pair below)
        box.begin_step()
        out = box.exchange(0, torch.tensor([1, 4]), torch.tensor([-1, -1], dtype=torch.int32),
                           torch.ones(1, 64, dtype=torch.bfloat16), torch.ones(1, 2))
        ok = ok and box.experts_computed == 2 and bool(torch.all(out == 0))  # zero weights: a zero sum
        new = {int(t) for t in os.listdir("/proc/self/task")} - before
        pinned = sorted(t for t in new if os.sched_getaffinity(t) == {cpu})
        box.close()
        res = {}
        def call():
            res["caller"] = ce.pin_caller()
            res["mask"] = sorted(os.sched_getaffinity(0))
        t = threading.Thread(target=call); t.start(); t.join()
        ce.configure(cpus=[])
        res["unpinned"] = ce.pin_caller()
        print(json.dumps({"cpu": cpu, "ok": ok, "new": len(new), "pinned": len(pinned), **res}))
    """)
    assert r["ok"]
    # the worker thread and the pool's second thread, both on the pool's first (only) CPU
    assert r["new"] == r["pinned"] == 2
    assert r["caller"] == r["cpu"] and r["mask"] == [r["cpu"]]
    assert r["unpinned"] is None
