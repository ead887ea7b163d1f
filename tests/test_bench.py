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
    # each graph's backward, compiled at its first backward, is a row of its own
    back = [c for c in first["compiles"] if c["fn"] == "forward_with_checkpointing (backward)"]
    assert back and back[0]["id"] == "0/0" and back[0]["s"] > 0
    assert "| forward_with_checkpointing | 0/0 |" in (tmp_path / "bench.md").read_text()
    assert "| decode |" in (tmp_path / "bench.md").read_text()
