"""Train the `demo` model that strata ships: a small DeepSeek-V3-style MoE with Engram layers (a dev tool).

    python -m strata.runtime.demo.train --work /tmp/strata-demo-train --out strata/runtime/demo/data/demo \\
        --words tests/data/demo_words.txt

1. The corpus (strata.runtime.demo.corpus): the King James Bible and fortune(6)'s fortunes-min cookies, from
   Debian's bible-kjv, bible-kjv-text and fortunes-min packages (`apt-get download`, `dpkg-deb -x`; run
   `apt-get update` first on a fresh host). About 4.5 MB of text in 2,795 documents.
2. The tokenizer: the demo byte-level BPE (strata.runtime.demo.tokenizer) retrained on that text, `VOCAB` ids,
   ChatML's special tokens at ids 0..2 as in every demo model.
3. The model (strata.runtime.demo.lm): `ARCH`, transformers' DeepseekV3ForCausalLM with `ENGRAM`'s layers,
   trained from scratch on random windows of `--seq` tokens: AdamW, linear warm-up, cosine decay. Routing is
   kept from collapsing by DeepSeek-V3's bias update (the selection-only `e_score_correction_bias`) with a
   dead band: an expert's bias moves only while its share of a step's routings is under `LOAD_BAND[0]` or over
   `LOAD_BAND[1]` times the even share, so every expert stays in use and the router keeps its natural skew.
4. The export: bf16 safetensors in DeepSeek-V3's names plus the Engram tensors, config.json,
   generation_config.json, the tokenizer files and the demo marker, into `--out`.

Reproducible: every random draw comes from `--seed`, so the same corpus, torch build and thread count give
the same model. Training writes `train.log` and `checkpoint.pt` (every `--save-every` steps) into `--work`;
a rerun resumes from the checkpoint, and `--export-only` writes `--out` from it at any point. Use `nice -n 10`
on a shared host. The shipped model is this command's defaults (`training.json` beside it records the run);
it took about two hours on one thread of a shared 2-core AMD EPYC (~1,200 tokens/s).
Needs transformers and safetensors (dev dependencies: `pip install -e .[dev]`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from strata.runtime.demo.configs import DEEPSEEK_COMMON, TRAINED_SIZE, demo_generation_config
from strata.runtime.demo.corpus import build_documents, fetch_packages, is_chat, word_list
from strata.runtime.demo.lm import DemoLM, export_checkpoint
from strata.runtime.demo.model import MARKER
from strata.runtime.demo.tokenizer import ENDOFTEXT, IM_END, SPECIAL_IDS, train_tokenizer_json, write_tokenizer_files
from strata.runtime.model.engram.hashing import EngramConfig, build_token_map

VOCAB = 4096
ARCH = {  # config.json's architecture fields (with DEEPSEEK_COMMON): ~8.8M parameters, ~18 MB in bf16
    "vocab_size": VOCAB, "hidden_size": 256, "intermediate_size": 768, "moe_intermediate_size": 32,
    "num_hidden_layers": 6, "first_k_dense_replace": 1, "n_routed_experts": 32, "num_experts_per_tok": 4,
    "n_group": 4, "topk_group": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 128,
    "kv_lora_rank": 64, "qk_rope_head_dim": 16, "qk_nope_head_dim": 32, "v_head_dim": 32,
    "max_position_embeddings": 2048,
}  # fmt: skip
ENGRAM = {"layer_ids": [1, 4], "engram_vocab_size": [4000, 4000], "max_ngram_size": 3, "n_head_per_ngram": 4,
          "n_embed_per_ngram": 64, "seed": 0, "kernel_size": 4}
LOAD_BAND = (0.25, 4.0)  # the bias update's dead band, in units of the even share 1/E
BIAS_STEP = 1e-3  # DeepSeek-V3's bias update speed
VAL_EVERY_DOC = 100  # every 100th document is held out for the validation loss
SAMPLE_PROMPTS = ("And the LORD said unto Moses,", "The experts of a mixture")


def model_config(token_map: torch.Tensor) -> dict:
    """The demo model's config.json dict, Engram section included (its compressed vocabulary from `token_map`)."""
    cfg = {**DEEPSEEK_COMMON, **ARCH, "bos_token_id": SPECIAL_IDS[ENDOFTEXT], "eos_token_id": SPECIAL_IDS[IM_END],
           "torch_dtype": "bfloat16", "dtype": "bfloat16"}
    engram = EngramConfig(**ENGRAM, compressed_vocab_size=int(token_map.max()) + 1, pad_id=SPECIAL_IDS[ENDOFTEXT])
    cfg["engram"] = engram.to_dict()
    return dict(sorted(cfg.items()))


def token_streams(docs: list[str], tokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, validation) token streams: each document after an <|endoftext|>, in a seeded shuffled order."""
    eot = SPECIAL_IDS[ENDOFTEXT]
    encoded = tokenizer.encode_batch(docs, add_special_tokens=False)
    train, val = [], []
    for i, (doc, enc) in enumerate(zip(docs, encoded, strict=True)):
        ids = enc.ids
        if not is_chat(doc) and any(t < len(SPECIAL_IDS) for t in ids):
            raise ValueError(f"document {i} holds a special token's text")
        (val if i % VAL_EVERY_DOC == VAL_EVERY_DOC - 1 else train).append([eot, *ids])
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(0)).tolist()
    flat = [t for i in order for t in train[i]]
    return torch.tensor(flat, dtype=torch.int64), torch.tensor([t for d in val for t in d], dtype=torch.int64)


def batch(stream: torch.Tensor, size: int, seq: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """`size` random windows of `seq` + 1 tokens: (inputs [size, seq], targets [size, seq])."""
    starts = torch.randint(0, stream.numel() - seq - 1, (size,), generator=gen)
    windows = torch.stack([stream[s : s + seq + 1] for s in starts.tolist()])
    return windows[:, :-1], windows[:, 1:]


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    """Linear warm-up to `peak`, then cosine decay to a tenth of it at `steps`."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, steps - warmup))
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def param_groups(model: DemoLM, lr: float, weight_decay: float) -> list[dict]:
    """Matrices decay; norms, biases and embeddings do not; Engram tables learn 5x faster (DeepSeek's Engram)."""
    decay, plain, tables = [], [], []
    for name, p in model.named_parameters():
        if "engram.multi_head_embedding" in name:
            tables.append(p)
        elif p.ndim < 2 or "embed_tokens" in name:
            plain.append(p)
        else:
            decay.append(p)
    return [{"params": decay, "weight_decay": weight_decay, "lr_scale": 1.0},
            {"params": plain, "weight_decay": 0.0, "lr_scale": 1.0},
            {"params": tables, "weight_decay": 0.0, "lr_scale": 5.0}]


class RoutingLoad:
    """Counts each MoE layer's routings during a forward pass (forward hooks on transformers' routers)."""

    def __init__(self, model: DemoLM):
        self.routers = model.routers()
        self.counts = {i: torch.zeros(r.e_score_correction_bias.numel()) for i, r in self.routers.items()}
        for i, r in self.routers.items():
            r.register_forward_hook(self._counter(i))

    def _counter(self, layer: int):
        def count(module, args, out) -> None:  # out: (router logits, weights [N, k], expert ids [N, k])
            self.counts[layer] += torch.bincount(out[2].reshape(-1), minlength=self.counts[layer].numel())
        return count

    def reset(self) -> None:
        for c in self.counts.values():
            c.zero_()

    def update_biases(self) -> dict[int, tuple[float, float]]:
        """DeepSeek's bias update inside `LOAD_BAND`; returns per layer (min, max) relative load."""
        spread = {}
        for i, r in self.routers.items():
            load = self.counts[i] / self.counts[i].mean().clamp_min(1e-9)  # 1.0: the even share
            step = (load < LOAD_BAND[0]).float() - (load > LOAD_BAND[1]).float()
            r.e_score_correction_bias.add_(BIAS_STEP * step)
            spread[i] = (float(load.min()), float(load.max()))
        return spread


@torch.no_grad()
def greedy(model: DemoLM, tokenizer, prompt: str, n: int = 40) -> str:
    """`n` greedy tokens after `prompt`, recomputing the whole sequence each step (the definition)."""
    ids = tokenizer.encode(prompt, add_special_tokens=False).ids
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return tokenizer.decode(ids)


@torch.no_grad()
def val_loss(model: DemoLM, val: torch.Tensor, seq: int, batches: int = 8) -> float:
    gen = torch.Generator().manual_seed(1234)  # the same windows every time
    losses = []
    for _ in range(batches):
        x, y = batch(val, 8, seq, gen)
        losses.append(F.cross_entropy(model(x).flatten(0, 1), y.flatten()).item())
    return sum(losses) / len(losses)


def prepare(work: Path) -> tuple[list[str], str]:
    """The corpus documents and the tokenizer.json trained on them (cached in `work`)."""
    docs_file, tok_file = work / "documents.json", work / "tokenizer.json"
    if not docs_file.exists():
        docs = build_documents(fetch_packages(work))
        plain = work / "plain.txt"  # the tokenizer trains on the plain documents (no ChatML markup)
        plain.write_text("\n\n".join(d for d in docs if not is_chat(d)) + "\n", encoding="utf-8")
        tok_file.write_text(train_tokenizer_json([plain], VOCAB), encoding="utf-8")
        docs_file.write_text(json.dumps(docs), encoding="utf-8")
    return json.loads(docs_file.read_text(encoding="utf-8")), tok_file.read_text(encoding="utf-8")


def export(model: DemoLM, config: dict, tokenizer_text: str, out: Path, record: dict) -> None:
    """Write the shipped directory `out` (replaced whole, through a temporary sibling)."""
    import shutil

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write_tokenizer_files(tmp, VOCAB, config["max_position_embeddings"], text=tokenizer_text)
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (tmp / "generation_config.json").write_text(json.dumps(demo_generation_config(), indent=2) + "\n")
    export_checkpoint(model, config, tmp / "model.safetensors")
    (tmp / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    marker = {"strata_demo": 1, "size": TRAINED_SIZE, "num_hidden_layers": config["num_hidden_layers"], "seed": 0,
              "engram": True}
    (tmp / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
    for f in tmp.iterdir():
        f.chmod(0o644)  # package data: readable by all (safetensors writes 0600)
    shutil.rmtree(out, ignore_errors=True)
    os.rename(tmp, out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m strata.runtime.demo.train", description=__doc__.split("\n")[0])
    p.add_argument("--work", type=Path, required=True, help="corpus, tokenizer, checkpoint.pt and train.log")
    p.add_argument("--out", type=Path, required=True, help="the model directory to write")
    p.add_argument("--words", type=Path, default=None, help="also write the corpus's word list here (the tests')")
    p.add_argument("--steps", type=int, default=1800)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=120)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--save-every", type=int, default=100)
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument("--export-only", action="store_true", help="write --out from the last checkpoint and stop")
    args = p.parse_args(argv)

    torch.set_num_threads(args.threads)
    args.work.mkdir(parents=True, exist_ok=True)
    log = open(args.work / "train.log", "a", buffering=1)  # noqa: SIM115 (open for the whole run)

    def say(msg: str) -> None:
        log.write(msg + "\n")
        print(msg, flush=True)

    from tokenizers import Tokenizer

    docs, tokenizer_text = prepare(args.work)
    tokenizer = Tokenizer.from_str(tokenizer_text)
    if args.words is not None:
        args.words.write_text("\n".join(word_list(docs)) + "\n", encoding="utf-8")
    train, val = token_streams(docs, tokenizer)
    token_map = build_token_map(tokenizer, VOCAB)
    config = model_config(token_map)
    torch.manual_seed(args.seed)
    model = DemoLM(config, token_map)
    opt = torch.optim.AdamW(param_groups(model, args.lr, args.weight_decay), lr=args.lr, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(args.seed)
    load = RoutingLoad(model)
    step, ckpt = 0, args.work / "checkpoint.pt"
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        gen.set_state(state["gen"])
        step = state["step"]
        say(f"resumed at step {step}")
    record = {"steps": step, "tokens": step * args.batch * args.seq, "batch": args.batch, "seq": args.seq,
              "lr": args.lr, "seed": args.seed, "threads": args.threads, "train_tokens": train.numel(),
              "val_tokens": val.numel(), "parameters": sum(p.numel() for p in model.parameters())}
    if args.export_only:
        record["val_loss"] = round(val_loss(model.eval(), val, args.seq), 4)
        export(model, config, tokenizer_text, args.out, record)
        say(f"exported step {step} (val loss {record['val_loss']}) to {args.out}")
        return 0
    say(f"{record['parameters'] / 1e6:.2f}M parameters, {train.numel()} train / {val.numel()} val tokens, "
        f"{args.steps} steps of {args.batch}x{args.seq}")
    model.train()
    t0, seen, running = time.perf_counter(), 0, []
    while step < args.steps:
        lr = lr_at(step, args.steps, args.lr, args.warmup)
        for g in opt.param_groups:
            g["lr"] = lr * g["lr_scale"]
        x, y = batch(train, args.batch, args.seq, gen)
        load.reset()  # only this step's routings move the biases
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        spread = load.update_biases()
        step += 1
        seen += x.numel()
        running.append(loss.item())
        if step % 20 == 0:
            rate = seen / (time.perf_counter() - t0)
            lo, hi = min(s[0] for s in spread.values()), max(s[1] for s in spread.values())
            say(f"step {step} loss {sum(running) / len(running):.3f} lr {lr:.2e} {rate:.0f} tok/s "
                f"load {lo:.2f}..{hi:.2f}")
            running = []
        if step % args.eval_every == 0 or step == args.steps:
            model.eval()
            say(f"step {step} val loss {val_loss(model, val, args.seq):.3f}")
            for prompt in SAMPLE_PROMPTS:
                say("  " + repr(greedy(model, tokenizer, prompt)))
            model.train()
        if step % args.save_every == 0 or step == args.steps:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "gen": gen.get_state(), "step": step},
                       ckpt.with_suffix(".tmp"))
            os.replace(ckpt.with_suffix(".tmp"), ckpt)
    model.eval()
    record.update(steps=step, tokens=step * args.batch * args.seq, val_loss=round(val_loss(model, val, args.seq), 4))
    export(model, config, tokenizer_text, args.out, record)
    say(f"exported to {args.out}: {record}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
