"""The llama.cpp side of bench/cpu/cpu_vs_llamacpp.py: one GGUF measured through llama-cpp-python's low-level API.

    python bench/cpu/llamacpp_side.py --gguf FILE --threads 2 --plan PLAN.json   # prints one JSON object

Runs in a process of its own, with the benchmark's private llama-cpp-python install on sys.path (PYTHONPATH), so
it never shares threads or memory with strata. PLAN.json (written by cpu_vs_llamacpp.py) says what to measure:

- `logits`: prompt ids whose log-probabilities at every position are written to an .npy file, for the check
  against strata's float32 logits;
- `prefill`: prompt lengths; each prompt (random ids, never seen before by the context) is decoded as one batch
  and timed from the call to the first token sampled (the plan's `temperature`: 1, llama.cpp's `dist` sampler over the
  whole vocabulary with a fixed seed; 0, its greedy sampler);
- `decode`: (streams, prompt, tokens): `streams` sequences share one context (a unified KV cache); their prompts are
  decoded as one batch, then every step decodes one token per sequence as one batch (`llama_batch` with a
  sequence id per row, llama.cpp's own batching) and samples each sequence's next token. The decode rate is the
  tokens sampled after the first one, over the time from the first token to the last.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import resource
import sys
import time

import numpy as np


def _quiet(L) -> None:
    """Silence llama.cpp's log (it writes every tensor's load line to stderr)."""
    cb = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)(lambda level, text, data: None)
    L.llama_log_set(cb, ctypes.c_void_p())
    _quiet.keep = cb  # the callback must outlive the process's llama.cpp calls


class Runner:
    """One model and one context of `n_seq` sequences, `n_ctx` tokens in all, on `threads` threads."""

    def __init__(self, gguf: str, threads: int, n_ctx: int, n_seq: int, n_batch: int, temperature: float = 1.0):
        import llama_cpp.llama_cpp as L

        self.L = L
        _quiet(L)
        L.llama_backend_init()
        mp = L.llama_model_default_params()
        mp.n_gpu_layers = 0
        t0 = time.perf_counter()
        self.model = L.llama_model_load_from_file(gguf.encode(), mp)
        if not self.model:
            raise SystemExit(f"llama.cpp could not load {gguf}")
        cp = L.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = n_ctx, n_batch, n_batch, n_seq
        cp.n_threads = cp.n_threads_batch = threads
        cp.kv_unified = True  # the sequences share the context's cells (each may use all of them)
        self.ctx = L.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise SystemExit("llama.cpp could not make a context")
        self.load_s = time.perf_counter() - t0
        self.vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        self.batch = L.llama_batch_init(n_batch, 0, n_seq)
        self.n_batch, self.temperature = n_batch, temperature

    def clear(self) -> None:
        self.L.llama_memory_clear(self.L.llama_get_memory(self.ctx), True)

    def decode(self, rows: list[tuple[int, int, int, bool]]) -> None:
        """One llama_decode of rows (token, position, sequence, wants logits)."""
        b, L = self.batch, self.L
        for i, (tok, pos, seq, out) in enumerate(rows):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, out
            b.seq_id[i][0] = seq
        b.n_tokens = len(rows)
        rc = L.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        L.llama_synchronize(self.ctx)

    def sampler(self, seed: int):
        L = self.L
        chain = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
        if self.temperature == 0:
            L.llama_sampler_chain_add(chain, L.llama_sampler_init_greedy())
            return chain
        if self.temperature != 1:
            L.llama_sampler_chain_add(chain, L.llama_sampler_init_temp(self.temperature))
        L.llama_sampler_chain_add(chain, L.llama_sampler_init_dist(seed))  # over the whole vocabulary
        return chain

    def logprobs(self, ids: list[int]) -> np.ndarray:
        """log-softmax of the logits at every position of `ids`: [len(ids), vocab] float32."""
        self.clear()
        out = np.empty((len(ids), self.vocab), dtype=np.float32)
        for start in range(0, len(ids), self.n_batch):
            part = ids[start : start + self.n_batch]
            self.decode([(t, start + j, 0, True) for j, t in enumerate(part)])
            for j in range(len(part)):
                out[start + j] = np.ctypeslib.as_array(self.L.llama_get_logits_ith(self.ctx, j), shape=(self.vocab,))
        out -= out.max(axis=1, keepdims=True)
        out -= np.log(np.exp(out).sum(axis=1, keepdims=True))
        return out

    def prefill(self, ids: list[int], seed: int) -> float:
        """Seconds from the prompt's decode call to its first sampled token."""
        self.clear()
        smpl = self.sampler(seed)
        t0 = time.perf_counter()
        for start in range(0, len(ids), self.n_batch):
            part = ids[start : start + self.n_batch]
            last = start + len(part) == len(ids)
            self.decode([(t, start + j, 0, last and j == len(part) - 1) for j, t in enumerate(part)])
        self.L.llama_sampler_sample(smpl, self.ctx, -1)
        seconds = time.perf_counter() - t0
        self.L.llama_sampler_free(smpl)
        return seconds

    def streams(self, prompts: list[list[int]], tokens: int, seed: int) -> dict:
        """Decode `tokens` tokens for each prompt, all sequences in one batch a step; the decode phase's rate."""
        self.clear()
        L = self.L
        samplers = [self.sampler(seed + s) for s in range(len(prompts))]
        t0 = time.perf_counter()
        nxt = []
        for s, prompt in enumerate(prompts):  # each prompt in calls of its own, sampled from its last row
            for start in range(0, len(prompt), self.n_batch):
                part = prompt[start : start + self.n_batch]
                self.decode([(t, start + j, s, start + j == len(prompt) - 1) for j, t in enumerate(part)])
            nxt.append(L.llama_sampler_sample(samplers[s], self.ctx, -1))
        t_first = time.perf_counter()
        pos = [len(p) for p in prompts]
        for _ in range(tokens - 1):
            self.decode([(nxt[s], pos[s], s, True) for s in range(len(prompts))])
            nxt = [L.llama_sampler_sample(samplers[s], self.ctx, s) for s in range(len(prompts))]
            pos = [p + 1 for p in pos]
        t_end = time.perf_counter()
        for smpl in samplers:
            L.llama_sampler_free(smpl)
        decoded = len(prompts) * (tokens - 1)
        return {"streams": len(prompts), "prompt": len(prompts[0]), "tokens": tokens,
                "prefill_s": t_first - t0, "decode_s": t_end - t_first, "decode_tok_s": decoded / (t_end - t_first)}


def page_in(path: str, chunk: int = 64 << 20) -> None:
    """Read the file once, so llama.cpp's mmap finds its pages in the page cache (strata copies its store into its
    own memory when it loads): neither engine reads the disk while it is timed."""
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(chunk)
        while f.readinto(buf):
            pass


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", required=True)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--plan", required=True, help="JSON: logits (ids, npy path), prefill, decode; see the docstring")
    args = p.parse_args(argv)
    plan = json.loads(open(args.plan).read())
    import llama_cpp

    page_in(args.gguf)
    runner = Runner(args.gguf, args.threads, n_ctx=plan["n_ctx"], n_seq=plan["n_seq"], n_batch=plan["n_batch"],
                    temperature=plan.get("temperature", 1.0))
    result: dict = {"engine": "llama.cpp", "llama_cpp_python": llama_cpp.__version__, "threads": args.threads,
                    "load_s": round(runner.load_s, 2),
                    "system_info": llama_cpp.llama_cpp.llama_print_system_info().decode().strip()}
    if plan.get("logits"):
        np.save(plan["logits"]["out"], runner.logprobs(plan["logits"]["ids"]))
    if plan.get("warmup"):  # a prompt that routes to (nearly) every expert, then every batch size the workloads use
        runner.prefill(plan["warmup"], seed=7)
        for d in plan.get("decode", []):
            runner.streams([plan["warmup"][: len(p)] for p in d["prompts"]], 4, seed=7)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_majflt
    result["prefill"] = [{"prompt": len(ids), "seconds": s, "tok_s": len(ids) / s}
                         for ids in plan.get("prefill", []) for s in [runner.prefill(ids, seed=11)]]
    result["decode"] = [runner.streams(d["prompts"], d["tokens"], seed=1000) for d in plan.get("decode", [])]
    # weights read back from disk while timed (page cache evicted): the round measures the disk, not the engine
    result["major_faults"] = resource.getrusage(resource.RUSAGE_SELF).ru_majflt - faults
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
