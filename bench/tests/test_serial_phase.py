"""bench/tools/serial_phase.py's reading of CUPTI kernel records: a split layer cut at the post and the answer's fetch
(either fetch), the ceiling's layer at its router, on synthetic traces whose phase lengths are known."""

from __future__ import annotations

import pytest

from bench.tools.serial_phase import analyse, kernel_records


def _trace(layers: int, cycle: list[tuple[str, float, int]], gap: float = 1.0) -> dict:
    """A chrome trace of `layers` repeats of `cycle` ((name, duration us, stream) run back to back, `gap` us apart),
    plus a host event the reader must skip."""
    events, t = [{"cat": "cpu_op", "name": "aten::zeros", "ts": 0.0, "dur": 5.0}], 0.0
    for _ in range(layers):
        for name, dur, stream in cycle:
            events.append({"cat": "kernel", "name": name, "ts": t, "dur": dur, "args": {"stream": stream}})
            t += dur + gap
    return {"traceEvents": events}


@pytest.mark.parametrize("fetch", [[("_fetch_kernel", 10.0, 7)], [("_acquire_kernel", 3.0, 7), ("_read_kernel", 2.0, 7)]])
def test_a_split_layer_is_cut_at_its_post_and_its_answer(fetch):
    cycle = [("_pack_kernel", 5.0, 7), ("_gate_up_kernel<bf16>", 40.0, 9), *fetch, ("_combine_kernel", 2.0, 7),
             ("_gemv_kernel", 7.0, 7), ("_route_kernel", 6.0, 7)]
    res = analyse("split", kernel_records(_trace(120, cycle)), {"serve_us": 50.0})
    # serial: the answer's end -> combine, gemv, route, pack, each 1 us after the last
    assert res["serial"]["length_us"] == pytest.approx(4 * 1.0 + 2 + 7 + 6 + 5)
    assert [k["kernel"] for k in res["serial"]["kernels"]][1:] == ["_combine_kernel", "_gemv_kernel", "_route_kernel",
                                                                     "_pack_kernel"]
    assert res["serial"]["idle_us"] == pytest.approx(4.0)
    # cold: the pack's end -> the GPU's own work (40 us) -> the fetch's end
    assert res["cold_us"] == pytest.approx(sum(d for _, d, _ in cycle[1:2] + fetch) + 1.0 + len(fetch))
    assert res["cold_gpu_work_us"] == pytest.approx(1.0 + 40.0)  # the wait for the worker is not the GPU's work
    assert res["worker"] == {"serve_us": 50.0}
    assert res["raw_layers"][0][0] == fetch[-1][0] and res["raw_layers"][0][3] == 0.0  # times from the answer's end


def test_the_ceilings_layer_runs_from_router_to_router():
    cycle = [("_route_kernel", 6.0, 7), ("_gate_up_kernel", 18.0, 7), ("_down_kernel", 11.0, 7),
             ("_combine_kernel", 2.0, 7), ("_gemv_kernel", 7.0, 7)]
    res = analyse("ceiling", kernel_records(_trace(20, cycle, gap=0.5)))
    layer = res["layer"]
    assert layer["runs"] == 19 and layer["same_sequence"] == 19
    assert layer["length_us"] == pytest.approx(18 + 11 + 2 + 7 + 6 + 5 * 0.5)


def test_a_steps_end_is_told_from_its_layers_and_its_idle_measured():
    """Steps of 4 split layers; after each step's last layer the LM head and the sampler run, then the GPU idles
    20 us for the next launch. The layers' serial phase stays the layers', the step's end gets its own table, and
    the cold phases' spread sees the answers that were there (a short acquire) and those it waited for."""
    cycle = [("_pack_kernel", 5.0, 7), ("_gate_up_kernel", 40.0, 9), ("_acquire_kernel", 2.0, 7),
             ("_read_kernel", 2.0, 7), ("_combine_kernel", 2.0, 7), ("_route_kernel", 6.0, 7)]
    events, t = [], 0.0
    for _ in range(10):
        for layer in range(4):
            for name, dur, stream in cycle:
                if name == "_acquire_kernel" and layer % 2:
                    dur = 12.0  # odd layers: the GPU waits for the worker
                events.append({"cat": "kernel", "name": name, "ts": t, "dur": dur, "args": {"stream": stream}})
                t += dur + 1.0
        for name, dur in (("_lm_head_gemv", 150.0), ("_sample_kernel", 4.0)):
            events.append({"cat": "kernel", "name": name, "ts": t, "dur": dur, "args": {"stream": 7}})
            t += dur + 1.0
        t += 19.0  # the launch: 20 us idle before the next step's first kernel
    res = analyse("split", kernel_records({"traceEvents": events}))
    assert res["serial"]["length_us"] == pytest.approx(3 * 1.0 + 2 + 6 + 5)  # the layers' own, not the step's end
    ends = res["step_ends"]
    assert ends["runs"] == 9 and [k["kernel"] for k in ends["kernels"]][-3:] == ["_lm_head_gemv", "_sample_kernel",
                                                                                   "_pack_kernel"]
    assert ends["length_us"] == pytest.approx(2 + 6 + 150 + 4 + 5 + 4 * 1.0 + 20.0)
    assert ends["idle_positive_us"] == pytest.approx(5 * 1.0 + 20.0 - 1.0)
    spread = res["spread"]
    assert spread["answer_there"] == pytest.approx(0.5, abs=0.03)  # even layers: a 2-us acquire
    assert spread["acquire_us"]["p10"] == 2.0 and spread["acquire_us"]["p90"] == 12.0
    assert spread["gpu_work_us"]["p50"] == pytest.approx(41.0)


def test_kernel_trace_summary_finds_the_slow_layer():
    """bench/tools/kernel_trace.py's summary of a run: per-stream busy time, and layer periods (answer to answer) whose
    slowest one is listed raw: here one layer of 100 waits 5 ms for its post."""
    from bench.tools.kernel_trace import summarize

    cycle = [("_pack_kernel", 5.0, 7), ("_gate_up_kernel", 40.0, 9), ("_acquire_kernel", 3.0, 7),
             ("_read_kernel", 2.0, 7), ("_combine_kernel", 2.0, 7)]
    events = _trace(100, cycle)["traceEvents"]
    slow = next(i for i, e in enumerate(events) if e.get("name") == "_pack_kernel" and e["ts"] > 2000)
    for e in events[slow:]:
        e["ts"] += 5000.0
    s = summarize(kernel_records({"traceEvents": events}))
    period = sum(d for _, d, _ in cycle) + len(cycle) * 1.0
    assert s["periods_us"]["n"] == 99 and s["periods_us"]["median"] == pytest.approx(period)
    assert s["periods_us"]["max"] == pytest.approx(period + 5000.0) and s["periods_us"]["over_2ms"] == 1
    assert s["slowest"][0][1][0] == "_combine_kernel" and s["slowest"][0][-1][0] == "_read_kernel"
    assert s["streams"]["7"]["busy_us"] == pytest.approx(100 * 12.0)
