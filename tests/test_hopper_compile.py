"""The decode kernels compile for Hopper without a GPU (tests/hopper_compile.py: Triton's GPU
passes and ptxas, which the interpreter never runs), and their loads are software-pipelined: a
bandwidth-bound loop that waits on each tile's load reads at a fraction of HBM's speed, and a
change to the loop's shape can silently lose the pipelining (the decode attention's static loop
with a skip compiled to one tile and no stages)."""

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO

pytest.importorskip("triton")


def test_the_decode_kernels_compile_for_sm90_with_their_loads_pipelined():
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    proc = subprocess.run([sys.executable, str(REPO / "tests/hopper_compile.py")], env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    launches = [json.loads(line) for line in proc.stdout.splitlines()]
    kinds = {(x["kernel"], x.get("FUSED"), x.get("DIRECT"), x.get("PEEL")) for x in launches}
    assert kinds >= {("matmul", None, None, None), ("merge", None, None, None),
                     ("attention", True, True, True), ("attention", True, False, True),
                     ("attention", True, True, False),
                     ("attention", False, True, False)}  # fmt: skip
    from trainer.decode_matmul import stage_bytes

    for x in launches:
        if x["kernel"] == "attention":  # K and V tiles (bf16) copied ahead, one set per stage
            # but the last (2 stages: 38.9 KB and 38 cp.async; 1 stage: 22.5 KB and none)
            assert x["async_copies"] > 0, x
            assert x["shared"] >= max(1, x["num_stages"] - 1) * 2 * x["BLOCK"] * x["D"] * 2, x
        elif x["kernel"] == "matmul":  # every stage the launch asked for
            assert x["shared"] >= x["num_stages"] * stage_bytes(x["BM"], x["BN"], x["BK"]), x
