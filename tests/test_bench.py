"""scripts/bench.py runs end to end on CPU with the tiny model (the GPU numbers are in docs/benchmarks.md)."""

import json
import subprocess
import sys

from conftest import REPO, env


def test_bench_cpu_smoke(tmp_path):
    # (c) with the decoder layers compiled, so that its compile report has something to report
    out = subprocess.run([sys.executable, "scripts/bench.py", "--device", "cpu", "--out", str(tmp_path),
                          "--grpo", "model.compile=true", "--startup"], cwd=REPO, env=env(), capture_output=True,
                         text=True, timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    r = json.loads((tmp_path / "bench.json").read_text())
    (decode,) = r["decode"]
    assert (
        decode["engine_s"] > 0 and decode["hf_static_s"] > 0 and decode["engine_tokens_per_s"] > 0
    )
    # the preset's engine, then SDPA over the whole cache
    assert [(v["attention"], v["spans"]) for v in decode["variants"]] == [("sdpa", 3), ("sdpa", 1)]
    (train,) = r["train"]
    assert train["tokens"] == 64 and train["step_s"] > 0 and train["overrides"] == ""
    first, grpo = r["grpo"]  # --startup: two launches on one fresh compile cache
    assert (first["launch"], grpo["launch"]) == ("first", "second")
    assert grpo["time/step_s"] > 0 and "time/rollout_s" in grpo
    # start-up: launch to step 1's metrics line, the workers' own account of it
    assert grpo["launch_to_step1_s"] > grpo["step1_s"] > 0
    assert grpo["startup"].startswith("ready after") and "model" in grpo["startup"]
    # each torch.compile of the run, from TORCH_TRACE: the decoder layer's at least, timed
    layer = [c for c in grpo["compiles"] if c["fn"] == "forward_with_checkpointing"]
    assert layer and layer[0]["s"] > 0 and layer[0]["id"] == "0/0"
    assert grpo["compile_s"] >= sum(c["s"] for c in layer)
    # the first launch compiled the layer from nothing; the second took it from that cache
    cold = [c for c in first["compiles"] if c["fn"] == "forward_with_checkpointing"]
    assert [c["id"] for c in cold] == [c["id"] for c in layer]
    for c, w in zip(cold, layer):  # "hits/graphs" (a cold compile counts its backward later)
        hits, graphs = w["cache_hits"]["inductor_fx"].split("/")
        assert c["cache_hits"]["inductor_fx"].startswith("0/") and hits == graphs != "0"
    # (the layer is dynamic from its first call, so its backward compiles with its forward: a
    # backward row of its own, for a graph compiled at its first backward, is tested below)
    assert "| forward_with_checkpointing | 0/0 |" in (tmp_path / "bench.md").read_text()
    assert "| decode |" in (tmp_path / "bench.md").read_text()


def test_compile_report_reads_each_compile_and_each_late_backward(tmp_path):
    """bench.py's compile table from a TORCH_TRACE folder: a forward's compilation metrics, and a
    backward compiled at its first backward (its own row, named after its forward)."""
    sys.path.insert(0, str(REPO / "scripts"))
    from bench import compile_report

    fwd = {"compilation_metrics": {
        "co_name": "forward", "compile_id": "2/0", "entire_frame_compile_time_s": 2.5,
        "backend_compile_time_s": 2.0, "aotautograd_local_cache_hit_count": 1,
        "aotautograd_local_cache_miss_count": 0, "inductor_fx_local_cache_hit_count": 0,
        "inductor_fx_local_cache_miss_count": 1, "recompile_reason": "size mismatch"}}  # fmt: skip
    bwd = {"bwd_compilation_metrics": {"compile_id": "2/0", "duration_us": 1_250_000,
                                       "inductor_compile_time_s": 1.0}}  # fmt: skip
    (tmp_path / "dedicated_log_torch_trace_rank_0_x.log").write_text(
        f"V1206 trace {json.dumps(fwd)}\nV1206 other line\nV1206 trace {json.dumps(bwd)}\n"
    )
    (tmp_path / "dedicated_log_torch_trace_rank_1_x.log").write_text(f"V trace {json.dumps(fwd)}\n")
    rows = compile_report(tmp_path)
    assert [(r["fn"], r["id"], r["s"], r["backend_s"]) for r in rows] == [
        ("forward", "2/0", 2.5, 2.0), ("forward (backward)", "2/0", 1.25, 1.0)]  # fmt: skip
    assert rows[0]["cache_hits"] == {"aotautograd": "1/1", "inductor_fx": "0/1"}
    assert rows[0]["recompile_reason"] == "size mismatch"
