"""Copy-ahead (strata.runtime.copy_ahead, strata.kernels.copy_ahead): the plan, the copy, the split that leaves the
copied tails out, the in-place kernel reading them from VRAM, and one-graph split decode with it on the GPU."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from strata.kernels import copy_ahead as ca

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
E, H, INTER, S = 16, 64, 32, 8


def _plan(ids, slot_of, budget, table, granules=4, rows=8, slots=S):
    rm, am = torch.zeros(E, dtype=torch.int32), torch.zeros(E, dtype=torch.int64)
    cs, cd, cr = torch.zeros(slots, dtype=torch.int64), torch.zeros(slots, dtype=torch.int64), torch.zeros(slots, dtype=torch.int32)
    cnt = torch.zeros(1, dtype=torch.int64)
    ca.plan_ahead_torch(torch.tensor(ids), slot_of, table, torch.tensor([budget], dtype=torch.int32), 1 << 20, 4096,
                        slots, granules, rows, rm, am, cs, cd, cr, cnt)
    return rm, am, cs, cd, cr, int(cnt)


@pytest.mark.parametrize("budget", [0, 1, 3, 6, 7, 40])
def test_plan_deals_the_budget_among_the_predicted_cold_experts(budget):
    """Only predicted experts without a GPU slot are staged, each in its own staging slot (in expert order); the
    budget's granules go one by one to them in turn, at most a whole expert each; the copy list names each staged
    expert's host slot, staging slot and rows; the counter adds the granules staged."""
    table = torch.arange(E, dtype=torch.int64) * 4096 + (1 << 30)
    slot_of = torch.full((E,), -1, dtype=torch.int32)
    slot_of[[5, 0]] = torch.tensor([2, 1], dtype=torch.int32)
    ids = [3, 5, 9, 1, 12, 7, 0, 2, 3, 9]  # two tokens' predictions; 5 and 0 resident
    rm, am, cs, cd, cr, cnt = _plan(ids, slot_of, budget, table)
    cold = [1, 2, 3, 7, 9, 12]
    want = {e: min(4, budget // 6 + (r < budget % 6)) * 8 for r, e in enumerate(cold)}
    assert {e: int(rm[e]) for e in range(E) if rm[e]} == {e: r for e, r in want.items() if r}
    assert cnt == sum(want.values()) // 8 == min(budget, 24)
    for r, e in enumerate(cold):
        staged = want[e] > 0
        assert int(am[e]) == ((1 << 20) + r * 4096 if staged else 0)
        assert (int(cs[r]), int(cd[r]), int(cr[r])) == ((int(table[e]), (1 << 20) + r * 4096, want[e]) if staged else (0, 0, 0))
    assert cr[len(cold):].tolist() == [0] * (S - len(cold))


def test_plan_stages_at_most_the_slots_there_are():
    table = torch.arange(E, dtype=torch.int64) + 1
    rm, _, _, _, cr, cnt = _plan(list(range(12)), torch.full((E,), -1, dtype=torch.int32), 100, table, slots=4)
    assert [e for e in range(E) if rm[e]] == [0, 1, 2, 3] and cr.tolist() == [32] * 4 and cnt == 16


def test_tail_offsets_cover_the_last_rows_of_gate_up_and_down():
    """A staged tail of a rows: gate rows [I - a, I), up rows [2I - a, 2I) and down's columns [I - a, I)."""
    a, down = 8, 2 * INTER * H
    off = ca.tail_offsets(a, INTER, H, down)
    slot = torch.zeros(3 * INTER * H, dtype=torch.bool)
    slot[off] = True
    assert off.numel() == 3 * a * H == int(slot.sum())
    gate_up = slot[:down].view(2 * INTER, H)
    assert gate_up[INTER - a : INTER].all() and gate_up[2 * INTER - a :].all() and int(gate_up.sum()) == 2 * a * H
    assert slot[down:].view(H, INTER)[:, INTER - a :].all()


def _share(share, granule=8):
    from strata.kernels.grouped import HostExperts
    from strata.runtime.gpu_share import GpuShare

    table = np.arange(E, dtype=np.int64)[None] * 4096 + 4096
    experts = HostExperts(torch.bfloat16, (2 * INTER, H), (H, INTER), 2 * INTER * H * 2)
    return GpuShare(table, experts, torch.device("cpu"), share, split=True, granule=granule, adaptive=False), table


@pytest.mark.parametrize("share", [0.0, 0.3, 0.45, 0.6])
@pytest.mark.parametrize("staged", [{}, {6: 8}, {6: 16, 1: 8}, {6: 32}, {6: 32, 1: 32, 4: 24}, {9: 16}])
def test_the_split_leaves_copied_tails_out(share, staged):
    """Each cold expert's rows are cut in three: the worker's leading rows, the in-place rows up to `end`, the
    staged tail from `end` on; the share splits only the granules not staged, at its optimum; a staged expert that
    is resident (9) or not routed is ignored; with nothing staged the split is `assign`'s without tails."""
    gs, table = _share(share)
    cold = [6, 1, 4, 7]
    flat = torch.tensor([6, 1, 4, 7, 0, 2, 5, 9] * 2)
    used = torch.tensor([-1 if e in cold else 3 for e in flat.tolist()], dtype=torch.int32)
    rows_map = torch.zeros(E, dtype=torch.int32)
    addr_map = torch.zeros(E, dtype=torch.int64)
    for e, r in staged.items():
        rows_map[e], addr_map[e] = r, 1000 + e
    new, addr, rows, end, st = gs.assign(0, flat, used, (rows_map, addr_map))
    plain = gs.assign(0, flat, used)
    if not any(e in cold for e in staged):
        assert all(torch.equal(a, b) for a, b in zip((new, addr, rows), plain, strict=True))
    per = {}
    for e, u, a, r, n, t in zip(flat.tolist(), new.tolist(), addr.tolist(), rows.tolist(), end.tolist(), st.tolist(),
                                strict=True):
        if e not in cold:
            assert u == 3 and a == 0 and t == 0
            continue
        tail = staged.get(e, 0)
        assert n == INTER - tail and t == (1000 + e if tail else 0) and 0 <= r <= n
        assert a == (int(table[0, e]) if r < n else 0) and (u == -2) == (r == 0)
        assert per.setdefault(e, (r, n)) == (r, n)
    total = sum(n for _, n in per.values()) // 8
    gpu = sum(n - r for r, n in per.values()) // 8
    ends = lambda q: max(q * (1 - share), (total - q) * share)  # noqa: E731
    assert ends(gpu) == pytest.approx(min(ends(q) for q in range(total + 1)))


def check_copy_ahead_kernels(dev: torch.device) -> None:
    """The plan kernel against its torch reference; the copy kernel against `copy_ahead_torch`; the in-place
    kernel reading staged tails from the staging slots against reading every row from the host slots; the fused
    pack with tails against `GpuShare.assign`. fp16 under the interpreter (it truncates bf16), bf16 on the GPU."""
    from strata.kernels import mailbox_pack
    from strata.kernels.grouped import HostExperts, pair_experts_in_place
    from strata.runtime.cpu_mailbox import _up
    from strata.runtime.gpu_share import GpuShare

    g = torch.Generator().manual_seed(0)
    dt = torch.bfloat16 if dev.type == "cuda" else torch.float16
    e, h, inter, k = 16, 64, 64, 4
    slot_el = 3 * h * inter
    host = (torch.randn(e, slot_el, generator=g) * 0.1).to(dt)
    if dev.type == "cuda":
        host = host.pin_memory()
    table = torch.tensor([host[i].data_ptr() for i in range(e)], dtype=torch.int64)
    stage = torch.zeros(S, slot_el, dtype=dt, device=dev)
    slot_of = torch.full((e,), -1, dtype=torch.int32)
    slot_of[[2, 11]] = torch.tensor([0, 1], dtype=torch.int32)
    ids = torch.tensor([1, 2, 5, 9, 11, 13, 14, 2])  # 2 tokens x top-4; 2 and 11 resident
    lists = []
    gen = torch.tensor([5], dtype=torch.int64, device=dev)
    for fn in (ca.plan_ahead_torch, ca.plan_ahead):
        out = [torch.zeros(e, dtype=torch.int32, device=dev), torch.zeros(e, dtype=torch.int64, device=dev),
               torch.zeros(S, dtype=torch.int64, device=dev), torch.zeros(S, dtype=torch.int64, device=dev),
               torch.zeros(S, dtype=torch.int32, device=dev), torch.zeros(1, dtype=torch.int64, device=dev)]
        word = torch.zeros(1, dtype=torch.int64, device=dev)
        fn(ids.to(dev), slot_of.to(dev), table.to(dev), torch.tensor([9], dtype=torch.int32, device=dev),
           stage.data_ptr(), slot_el * 2, S, 4, 16, *out, tag=(word, gen, 3))
        assert int(word) == 5 * ca.TAG_STRIDE + 3  # the plan's tag: the generation and the planned layer
        lists.append(out)
    for a, b in zip(*lists, strict=True):
        assert torch.equal(a.cpu(), b.cpu())
    rm, am, cs, cd, cr, cnt = lists[1]
    assert int(cnt) == 9 and cr.tolist() == [32, 32, 32, 32, 16, 0, 0, 0]  # cold 1, 5, 9, 13, 14: 9 granules dealt
    if dev.type == "cuda":
        ca.copy_ahead(cs, cd, cr, torch.zeros(1, dtype=dt, device=dev), inter, h, 2 * inter * h)
    else:  # the interpreter's programs are slow: fewer, with smaller blocks (still several blocks a program)
        ca.launch_copy(cs, cd, cr, inter, h, 2 * inter * h, programs=3, block=64, rows=2)
    ref = torch.zeros_like(stage)
    owner = {int(table[i]): i for i in range(e)}
    ca.copy_ahead_torch(host.to(dev), torch.tensor([owner.get(int(s), 0) for s in cs.tolist()]), cr.cpu(), ref, inter, h,
                        2 * inter * h)
    assert torch.equal(stage, ref) and int((stage != 0).sum()) == 3 * h * int(cr.sum())
    # the pack's split with the tails, then the in-place kernel reading them from VRAM
    experts = HostExperts(dt, (2 * inter, h), (h, inter), 2 * inter * h * 2)
    gs = GpuShare(table.numpy()[None], experts, dev, 0.45, adaptive=False, granule=16)
    x = torch.randn(2, h, generator=g).to(dt).to(dev)
    w = torch.rand(2, k, generator=g).to(dt).to(dev)
    flat, used = ids.to(dev), slot_of[ids].to(dev)
    want = gs.assign(0, flat, used, (rm, am))
    p = flat.numel()
    x_off = _up(16 + 12 * p, 64)
    box = torch.zeros(x_off + 4 * 2 * h + 4 * p, dtype=torch.uint8, device=dev)
    rows, addr = torch.empty(p, dtype=torch.int32, device=dev), torch.empty(p, dtype=torch.int64, device=dev)
    end, staged, stat = (torch.empty(p, dtype=torch.int32, device=dev), torch.empty(p, dtype=torch.int64, device=dev),
                         torch.zeros(1, dtype=torch.int64, device=dev))
    mailbox_pack.pack_mailbox(box, flat, used, x, w, x_off, inter, gs, 0, rows=rows, addr=addr,
                              ahead=(rm, am, end, staged, stat))
    slots_box = box[16 + 4 * p : 16 + 8 * p].view(torch.int32)
    for a, b in zip(want, (slots_box, addr, rows, end, staged), strict=True):
        assert torch.equal(a.cpu(), b.cpu())
    assert int(stat) == int(cnt)  # every staged expert is cold and routed here
    assert bool((end < inter).any()) and bool((staged != 0).any())
    # tails the worker copies count only once its flag holds this step's tag: then as above, else as if none
    for flag_tag, landed in ((5 * ca.TAG_STRIDE, True), (4 * ca.TAG_STRIDE, False), (5 * ca.TAG_STRIDE + 1, False)):
        gate = (torch.tensor([flag_tag], dtype=torch.int64, device=dev), gen, 0)
        want_g = gs.assign(0, flat, used, (ca.gated_rows(rm, gate), am))
        out_g = (torch.empty(p, dtype=torch.int32, device=dev), torch.empty(p, dtype=torch.int64, device=dev),
                 torch.empty(p, dtype=torch.int32, device=dev), torch.empty(p, dtype=torch.int64, device=dev),
                 torch.zeros(1, dtype=torch.int64, device=dev))
        box_g = torch.zeros_like(box)
        mailbox_pack.pack_mailbox(box_g, flat, used, x, w, x_off, inter, gs, 0, rows=out_g[0], addr=out_g[1],
                                  ahead=(rm, am, out_g[2], out_g[3], out_g[4], gate))
        for a, b in zip(want_g, (box_g[16 + 4 * p : 16 + 8 * p].view(torch.int32), *out_g[1::-1], *out_g[2:4]),
                        strict=True):
            assert torch.equal(a.cpu(), b.cpu())
        assert torch.equal(out_g[0].cpu(), rows.cpu()) == landed and int(out_g[4]) == (int(cnt) if landed else 0)
        assert bool((out_g[3] != 0).any()) == landed and bool((out_g[2] == inter).all()) != landed
    y = torch.zeros(p, h, dtype=torch.float32, device=dev)
    pair_experts_in_place(x, experts, addr, y, first_row=rows, staged=staged, last_row=end)
    full = torch.where((addr != 0) | (staged != 0), table.to(dev)[flat], 0)  # the same rows, all from host RAM
    y_ref = torch.zeros_like(y)
    pair_experts_in_place(x, experts, full, y_ref, first_row=rows)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6)
    assert bool((y.abs().sum(1) > 0).any())


def test_copy_ahead_kernels_under_tritons_interpreter():
    pytest.importorskip("triton")
    code = "import torch, tests.test_copy_ahead as t\nt.check_copy_ahead_kernels(torch.device('cpu'))\nprint('ok')\n"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-3000:]


@pytest.mark.gpu
def test_copy_ahead_kernels_on_the_gpu():
    check_copy_ahead_kernels(torch.device("cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("engine", ["copy", "sm"])
def test_one_graph_split_decode_with_copy_ahead_follows_memory(tmp_path, monkeypatch, engine):
    """Tails of the next layer's predicted cold experts copied to VRAM during the serial phase (by the worker on
    the copy engine, or by the SM kernel in the graph): the tokens stay those of the all-in-memory engine (within
    the forked numerics' tolerance, as without copy-ahead), in one graph a step; the tails are used (the
    prediction is the checkpoint's own router), and the worker reads fewer bytes than with copy-ahead off at the
    same fixed share: fewer a served expert, since the tokens after the fourth may differ (the tails' rows take the
    GPU's rounding), and with them which experts run cold. Off, the engine has no copy-ahead."""
    from mailbox_engines import one_graph_decode, tiny_split_setup

    model, cfg, ids, want = tiny_split_setup(tmp_path)
    monkeypatch.setenv("STRATA_MAILBOX_GPU_SHARE", "0.35")
    monkeypatch.setenv("STRATA_COPY_AHEAD_ENGINE", engine)
    computed, stats = {}, {}
    for ahead in ("0", str(2 * 3072)):  # off; on with two granules (8 rows of the tiny expert's 32) a layer
        monkeypatch.setenv("STRATA_COPY_AHEAD", ahead)
        with one_graph_decode(model, cfg, ids, want) as (tiered, read, groups):
            assert (tiered._compute.copy_ahead is None) == (ahead == "0")
            assert read > 0 and groups > 0
            computed[ahead] = read / groups
            if ahead != "0":
                tiered._compute.copy_ahead.apply()
                torch.cuda.synchronize()
                stats = tiered._compute.mailbox_stats()["copy_ahead"]
    assert stats["engine"] == engine and stats["budget_granules"] == 2 and stats["staged_granules"] > 0
    if engine == "copy":  # the worker copied them, without a driver error; some landed before the next pack
        assert stats["copied_tails"] > 0 and stats["copy_errors"] == 0 and stats["used_granules"] > 0
    else:
        assert stats["used_fraction"] > 0.5  # the tails were of experts the next layer computed cold
    assert computed[str(2 * 3072)] < computed["0"]  # bytes a served expert


@pytest.mark.gpu
def test_one_graph_split_decode_with_warm_ahead_changes_no_token(tmp_path, monkeypatch):
    """Copy-ahead's "cpu" engine (warm-ahead, `runtime.warm_ahead`, on by default): the worker reads the next
    layer's predicted cold experts into its threads' caches; nothing is staged and the split is untouched, so at a
    fixed share the 16 tokens are those of the run without it, bit for bit, and the worker computed rows it had
    read ahead. Its byte budget follows $STRATA_COPY_AHEAD; "0" or the config turns it off."""
    from mailbox_engines import one_graph_decode, tiny_split_setup

    from strata.runtime.copy_ahead import CopyAhead, warm_budget

    model, cfg, ids, want = tiny_split_setup(tmp_path)
    monkeypatch.setenv("STRATA_MAILBOX_GPU_SHARE", "0.35")
    tokens, stats = {}, {}
    off = {**cfg, "runtime": {"warm_ahead": False}}
    for name, env, config in (("off", "", off), ("zero", "0", cfg), ("default", "", cfg), ("budget", "100000", cfg)):
        monkeypatch.setenv("STRATA_COPY_AHEAD", env)
        monkeypatch.setenv("STRATA_COPY_AHEAD_ENGINE", "cpu" if name == "budget" else "")
        with one_graph_decode(model, config, ids, want) as (tiered, read, groups):
            assert (tiered._compute.copy_ahead is None) == (name in ("off", "zero"))
            tokens[name] = tiered.generate(ids, max_tokens=16).token_ids
            if tiered._compute.copy_ahead is not None:
                stats[name] = tiered._compute.mailbox_stats()["copy_ahead"]
                threads = tiered._compute.mailbox.threads
    assert tokens["off"] == tokens["zero"] == tokens["default"] == tokens["budget"]
    assert stats["default"]["warm_bytes"] == warm_budget(CopyAhead.WARM_BYTES, threads) > 0
    assert stats["budget"]["warm_bytes"] == 100000
    for s in stats.values():
        assert s["engine"] == "cpu" and s["plans_used"] > 0 and s["read_bytes"] > 0 and s["computed_bytes"] > 0


def _copy_ahead(budget_bytes=None):
    from strata.runtime.copy_ahead import CopyAhead

    gs, table = _share(0.4)
    predictors = {i: (lambda h: h) for i in (0, 1, 2, 4)}
    return CopyAhead(np.repeat(table, 5, axis=0), torch.full((5, E), -1, dtype=torch.int32), gs, predictors,
                     [0, 1, 2, 4], torch.device("cpu"), 3 * H * INTER * 2, budget_bytes=budget_bytes)


def test_only_consecutive_moe_layers_plan_ahead():
    """Layer l plans l + 1 where both are MoE layers with a predictor (3 is dense here): 0 -> 1 -> 2, not 2 -> 4."""
    assert _copy_ahead().next_of == {0: 1, 1: 2}


def test_budget_is_a_link_time_in_whole_granules():
    """By default the budget is AHEAD_US of link time at the share's in-place rate, in whole granules; a fixed or
    a new budget too; the device's budget changes only at `apply` (stream-ordered, between steps)."""
    ahead = _copy_ahead()
    gran = ahead.granule_bytes  # 8 rows x 3 x 64 x 2 bytes
    assert ahead.value == int(ahead.AHEAD_US * 1e-6 * ahead.share.gpu_rate // gran) == int(ahead.budget)
    ahead.set_budget(3 * gran - 1)
    assert ahead.target == 2 and int(ahead.budget) == ahead.value != 2
    ahead.apply()
    assert int(ahead.budget) == ahead.value == 2
    assert _copy_ahead(budget_bytes=5 * gran + 1).value == 5
