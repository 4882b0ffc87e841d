"""Engram rows from disk inside one CUDA graph per decode step: the GPU asks a host thread for a step's rows
through page-locked memory and waits on the device for each Engram layer's answer.

Rows of tables on disk come through the host row cache, which the GPU reads in place (`gather_view` of
`EngramRowStore`); only the host can read the disk and keep the cache. Without this module each Engram
layer ends a graph segment: the host hashes the new tokens after sampling, then serves a layer's rows
between segments. With it the step stays one graph, and the host's work starts as soon as the GPU has
hashed the tokens, overlapping the layers before the first Engram layer:

    GPU, in the step's graph                            host thread (`_serve`)
    gen += 1; request <- row ids [L, B*heads]
    ready <- gen                                 --->   sees ready == gen (a native wait, GIL free)
    layer 0 ...                                         the first Engram layer's rows looked up, the misses
    wait until done[0] == gen                    <---   read (in this thread: Linux AIO, all in flight) and
    gather cache[answer[0]] (slots, in place)           admitted to the cache; answer[0] <- slots, done[0] <- gen
    ...                                                 the next layer's, done[1] <- gen, ...

`gen` is a device counter the graph bumps, so replays need no host writes; the host thread is woken for
each step (`expect`) and serves the generations in order. Ordering: the GPU writes `ready` after the
request (stream order); the host writes the slab rows and the answer before `done` (x86 keeps stores in
order); the wait kernel reads `done` volatile, and the gather that follows reads the answer and the rows.
A step's rows evict no row the same step uses (`EngramRowStore.finish_one`'s protection), and none a
previous step used: `ready` of step t is written after step t-1's gathers ran.

Invariant for callers: the main thread does not run the store's host path (`start`/`wait`) for a step while
an earlier handshake step is still queued on the GPU (the scheduler syncs on every step's logits first):
the store's lock is held while serving, and a host-path wait on the GPU under that lock would deadlock.
"""

from __future__ import annotations

import logging
import threading
import time

import torch

from strata.tiers.storage import native_io

log = logging.getLogger(__name__)

HEADER_WORDS = 64  # int64: [0] ready, [1] tokens, [2] the GPU gave up (its generation), [8 + i] done, [32 + i] spins
MAX_LAYERS = 24
SPIN_NS = 2_000_000  # the host thread polls `ready` without sleeping this long after being woken


class RowHandshake:
    """The page-locked exchange between a decode graph and the host thread serving `source`'s rows.

    source: an `EngramRowStore` whose row cache the GPU reads in place (`gather_view` on CUDA);
    layers: its Engram layers, in model order; heads: rows per token and layer; max_tokens: the largest step."""

    def __init__(self, source, layers: list[int], heads: int, max_tokens: int, device: torch.device):
        from strata.kernels.gpu import host_signal
        from strata.tiers.storage.uva import device_view

        cuda = device.type == "cuda"
        if (cuda and not host_signal.available()) or not native_io.available():
            raise RuntimeError("the Engram rows' handshake needs Triton (on CUDA) and the native helpers")
        if len(layers) > MAX_LAYERS:
            raise RuntimeError(f"the handshake holds at most {MAX_LAYERS} Engram layers, got {len(layers)}")
        self.source, self.layers, self.heads, self.max_tokens = source, list(layers), heads, max_tokens
        self.device = device
        width = max_tokens * heads
        words = HEADER_WORDS + 2 * len(self.layers) * width
        # header | request [L, width] | answer [L, width]; on a CPU-only host (tests) the "device" side is the
        # same memory, and `rows` waits for the host thread with the native wait instead of a GPU kernel
        self._host = torch.zeros(words, dtype=torch.int64)
        self._host = self._host.pin_memory() if cuda else self._host
        self._dev = device_view(self._host, device) if cuda else self._host
        if self._dev is None:
            raise RuntimeError("the GPU cannot read page-locked memory in place here (no unified addressing)")
        arr = self._host.numpy()
        self.header = arr[:HEADER_WORDS]
        body = arr[HEADER_WORDS:].reshape(2, len(self.layers), width)
        self.request, self.answer = body[0], body[1]  # numpy views: the host side
        dev_body = self._dev[HEADER_WORDS:].view(2, len(self.layers), width)
        self._request_dev, self._answer_dev = dev_body[0], dev_body[1]
        self._base = self._host.data_ptr()
        self.gen = torch.zeros(1, dtype=torch.int64, device=device)  # the step's generation, bumped in the graph
        self._index = {layer: i for i, layer in enumerate(self.layers)}
        self.error: BaseException | None = None  # the host thread's failure, raised by `check`
        self.steps = 0  # steps served
        self.serve_s = 0.0  # host seconds from seeing `ready` to the last `done`
        self.first_s = 0.0  # from seeing `ready` to the first layer's `done` (what the GPU may wait for)
        self.gpu_spins = 0  # the GPU's reads of `done` before the host had answered, over the served steps
        self._served = 0  # generations served
        self._wanted = 0  # steps the host thread was woken for
        self._cv = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._loop, name="strata-engram-rows", daemon=True)
        self._thread.start()

    # ---- the device side: ops a decode graph captures ------------------------------------------------
    def post(self, ids: dict[int, torch.Tensor]) -> None:
        """Hand a step's row ids (per layer int64 [B, heads], device) to the host: the request, then `ready`."""
        b = next(iter(ids.values())).shape[0]
        if b > self.max_tokens:
            raise ValueError(f"the handshake holds {self.max_tokens} tokens a step, got {b}")
        self.gen.add_(1)
        for layer, rows in ids.items():
            self._request_dev[self._index[layer], : b * self.heads].copy_(rows.reshape(-1))
        self._dev[1:2].fill_(b)
        self._dev[0:1].copy_(self.gen)  # ready: after the request (stream order)

    def rows(self, layer: int, b: int) -> torch.Tensor:
        """Layer `layer`'s rows [B, heads, dim] gathered in place from the source's host row cache once the host
        has answered: the stream waits on the device for `done`."""
        i = self._index[layer]
        if self.device.type == "cuda":
            from strata.kernels.gpu.host_signal import wait_for_host

            h = self._host
            wait_for_host(h[8 + i : 9 + i], self.gen, h[2:3], h[32 + i : 33 + i])
        elif not native_io.wait_word(self._base + 8 * (8 + i), int(self.gen), 0, 30_000_000_000):
            raise RuntimeError(f"the Engram rows' host thread did not answer layer {layer}")
        view = self.source.gather_view  # [cache rows, dim]
        slots = self._answer_dev[i, : b * self.heads]
        return view[slots].view(b, self.heads, view.shape[-1])

    # ---- the host side -------------------------------------------------------------------------------
    def expect(self) -> None:
        """A step that posts a request was just queued: wake the host thread for it."""
        with self._cv:
            self._wanted += 1
            self._cv.notify()

    def check(self) -> None:
        """Raise what went wrong serving a step (a failed read, the GPU giving up waiting), once."""
        if self.header[2] != 0:
            gen, self.header[2] = int(self.header[2]), 0
            raise RuntimeError(f"a decode step gave up waiting for its Engram rows (step {gen}); set "
                               "[debug] engram_graph_wait = false to serve rows between graph segments instead")
        if self.error is not None:
            e, self.error = self.error, None
            raise RuntimeError(f"serving a decode step's Engram rows failed: {e}") from e

    def stats(self) -> dict:
        """Steps served, host seconds serving them, the GPU's reads of `done` before an answer (its wait)."""
        return {"steps": self.steps, "serve_s": self.serve_s, "first_layer_s": self.first_s,
                "gpu_wait_spins": self.gpu_spins}

    def close(self) -> None:
        with self._cv:
            self._closing = True
            self._cv.notify()
        self._thread.join(timeout=5)

    def _loop(self) -> None:
        with torch.inference_mode(False):  # the store's buffers are made outside inference mode
            while True:
                with self._cv:
                    while self._wanted == 0 and not self._closing:
                        self._cv.wait()
                    if self._closing:
                        return
                    self._wanted -= 1
                want = self._served + 1
                # a woken-for step that never ran leaves this waiting for the next one that does: generations
                # count the graph's runs, not the wake-ups
                while not native_io.wait_word(self._base, want, SPIN_NS, 100_000_000):
                    if self._closing:
                        return
                self._serve(want)
                self._served = want

    def _serve(self, gen: int) -> None:
        t0 = time.perf_counter()
        spins = self.header[32 : 32 + len(self.layers)]
        self.gpu_spins += int(spins.sum())  # the previous step's waits: final, as its graph has finished
        spins[:] = 0
        b = int(self.header[1])
        n = b * self.heads
        done = 0
        try:
            with self.source.lock:
                held: list = []
                # layer by layer, each read in this thread and answered before the next is looked up: a disk that
                # serves a few tens of thousands of random reads a second answers the first layer (which the GPU
                # reaches after one layer's work) sooner alone than sharing its queue with the later layers' reads,
                # and those still land while the GPU runs the layers before theirs
                for i, layer in enumerate(self.layers):
                    self.source.serve_layer(layer, self.request[i, :n], held, self.answer[i, :n])
                    self.header[8 + i] = gen  # done: after the rows and their slots
                    if i == 0:
                        self.first_s += time.perf_counter() - t0
                    done = i + 1
        except BaseException as e:  # noqa: BLE001 - reported by `check`; the GPU must not wait for nothing
            log.error("serving Engram rows for a decode step failed: %s", e)
            self.error = e
            self.answer[done:, :n] = 0
            for i in range(done, len(self.layers)):
                self.header[8 + i] = gen
        self.steps += 1
        self.serve_s += time.perf_counter() - t0

