"""Throughput, MFU and memory, per step.

Training FLOPs (forward + backward) for a sequence of S tokens through a decoder with L
layers, Hq query heads of width d, and N_matmul = L * (parameters per layer) + V * H (the
lm_head product; the embedding lookup costs nothing):

    flops = 6 * N_matmul * S + 6 * L * Hq * d * S^2

the second term being causal attention (QK^T and AV, 2 S^2 d each per head forward, halved
for the causal mask, times 3 for forward + backward). MFU = flops over all updates / (train
seconds * ranks * peak), with the peak from `trainer.peak_tflops`, or the dense bf16 datasheet
value for GPUs it knows; on CPUs and unknown GPUs MFU is not logged.
"""

from __future__ import annotations

import resource

import torch

from launcher.counting import count_params

DATASHEET_BF16_TFLOPS = {"H200": 989.5, "H100": 989.5, "A100": 312.0, "L40S": 362.0}


def train_flops(config, tokens: float, sum_sq_len: float) -> float:
    """Forward + backward FLOPs for `tokens` tokens in sequences whose squared lengths sum to sum_sq_len."""
    attn = 6 * config.num_hidden_layers * config.num_attention_heads * config.head_dim * sum_sq_len
    return 6 * count_params(config).matmul * tokens + attn


def peak_flops(device: torch.device, peak_tflops: float) -> float | None:
    if peak_tflops > 0:
        return peak_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v * 1e12 for k, v in DATASHEET_BF16_TFLOPS.items() if k in name), None)


class PhasePeaks:
    """Peak allocated GPU memory per phase of a step (launcher/memory.py predicts the same
    phases): `mark(phase)` closes the phase that just ran. Nothing on CPU."""

    def __init__(self, device: torch.device):
        self.device, self.peaks = device, dict[str, float]()
        if device.type == "cuda":  # the first phase starts here, not at the last reset
            torch.cuda.reset_peak_memory_stats(device)

    def mark(self, phase: str) -> None:
        if self.device.type == "cuda":
            gb = torch.cuda.max_memory_allocated(self.device) / 1e9
            self.peaks[phase] = max(self.peaks.get(phase, 0.0), gb)
            torch.cuda.reset_peak_memory_stats(self.device)

    def step_peak(self) -> float | None:
        return max(self.peaks.values()) if self.peaks else None


def peak_memory_gb(device: torch.device) -> float:
    """Peak allocated GPU memory since the last call, or the process's peak RSS on CPU."""
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) / 1e9
        torch.cuda.reset_peak_memory_stats(device)
        return peak
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # KiB on Linux
