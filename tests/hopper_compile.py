"""Compile the decode kernels for Hopper (sm_90) on a machine without a GPU, as their launches at
Qwen3-4B's shapes would: Triton's front end, its GPU passes (pipelining, wgmma) and ptxas, which
the interpreter the CPU tests run never reaches. Prints one JSON line per compiled launch.

    TRITON_INTERPRET=0 python tests/hopper_compile.py   # tests/test_hopper_compile.py runs it

Each launch goes through the modules' own launch code with the kernels swapped for recorders;
each recorded call is then compiled with the specialisation Triton's JIT would give it (16-byte
aligned pointers and ints divisible by 16 marked so, ints equal to 1 made constants)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

os.environ["TRITON_INTERPRET"] = "0"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from trainer import decode_attention as da  # noqa: E402
from trainer import decode_matmul as dm  # noqa: E402

TYPES = {torch.bfloat16: "bf16", torch.float32: "fp32", torch.bool: "i1", torch.int64: "i64"}
SMS = 132  # an H100's or H200's
QWEN3_4B = SimpleNamespace(hidden_size=2560, head_dim=128, num_attention_heads=32,
                           num_key_value_heads=8, intermediate_size=9728)  # fmt: skip


class Recorder:
    def __init__(self, name, fn, calls):
        self.name, self.fn, self.calls = name, fn, calls

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((self.name, self.fn, args, kwargs))


def compile_call(fn, args, kwargs):
    """The kernel compiled for sm_90 as the JIT would specialise this call."""
    names = [p.name for p in fn.params]
    bound = {**dict(zip(names, args)), **kwargs}
    sig, const, attrs = {}, {}, {}
    for i, p in enumerate(fn.params):
        v = bound[p.name]
        if p.is_constexpr or (isinstance(v, int) and not isinstance(v, bool) and v == 1):
            sig[p.name], const[(i,)] = "constexpr", v
        elif isinstance(v, torch.Tensor):
            sig[p.name] = "*" + TYPES[v.dtype]
            if v.data_ptr() % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, bool):
            sig[p.name] = "i1"
        elif isinstance(v, int):
            sig[p.name] = "i32" if abs(v) < 2**31 else "i64"
            if v % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[p.name] = "fp32"
    options = {k: kwargs[k] for k in ("num_warps", "num_stages") if k in kwargs}
    src = ASTSource(fn, sig, constexprs=const, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def main() -> None:
    calls: list = []
    for module, names in ((da, ("attention", "merge")), (dm, ("matmul",))):
        module._kernels = tuple(Recorder(n, f, calls) for n, f in zip(names, module.load()))
    dm.sm_count = lambda device: SMS  # config_for as on the GPU
    bf = torch.bfloat16
    hd, kv, heads, length = 128, 8, 32, 384  # QWEN3_4B's heads, a cache of prompt 128 + 256
    for b in (64, 256):
        for n, k in dm.projections(QWEN3_4B):
            dm.decode_linear(torch.zeros(b, k, dtype=bf), torch.zeros(n, k, dtype=bf))
    n_qkv = (heads + 2 * kv) * hd
    for b, split, partials, peel in ((64, 0, 2, True), (8, 128, 2, True), (64, 0, 1, False)):
        qkv = torch.zeros(partials, b, n_qkv, dtype=torch.float32 if partials > 1 else bf)
        cache = torch.zeros(b, kv, length, hd, dtype=bf)
        norm, rope = torch.ones(hd, dtype=bf), torch.zeros(b, hd, dtype=bf)
        valid, col = torch.ones(b, length, dtype=torch.bool), torch.zeros(1, dtype=torch.long)
        da.launch_qkv(
            qkv, norm, norm, rope, rope, cache, cache, valid, col, heads, 1e-6, split, peel
        )
    cache = torch.zeros(8, kv, length, hd, dtype=bf)
    q = torch.zeros(8, kv, heads // kv, hd, dtype=bf)
    da.launch(q, cache, cache, torch.ones(8, length, dtype=torch.bool), col, 0)
    for name, fn, args, kwargs in calls:
        kernel = compile_call(fn, args, kwargs)
        shown = {k: v for k, v in kwargs.items() if isinstance(v, (int, bool, str))}
        copies = kernel.asm["ptx"].count("cp.async.cg") + kernel.asm["ptx"].count("cp.async.ca")
        print(json.dumps({"kernel": name, "shared": kernel.metadata.shared, "async_copies": copies,
                          **shown}), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
