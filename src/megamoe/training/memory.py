"""Whether a `megamoe train` run fits its device, asked before anything is allocated.

:func:`estimate` is a rough, closed-form count per rank (no model is built):

- the parameters: counted from the preset's shape as transformers' Qwen3-MoE lays them out (embeddings and
  LM head, per layer attention, norms, router and the experts), the routed experts split over the ranks, the
  rest replicated; FP32 master weights;
- their gradients (FP32) and AdamW's two moments (FP32): with the weights, 16 bytes per parameter of the rank;
- the routed experts' BF16 copies: their weights as the kernels read them, their BF16 gradients and those
  gradients' FP32 casts, 8 bytes per expert parameter of the rank;
- the activations one step keeps for its backward, in FP32 elements of the rank's tokens T (a transformer
  layer's usual tensors, not a profile of this one): per layer about T x (6 hidden + 4 heads x head_dim
  + 4 kv_heads x head_dim + 2 experts) for attention, norms and router, T x top_k x (2 hidden + 3
  intermediate) for the routed rows, and with eager attention (the CPU's) 3 x batch x heads x sequence^2
  for the scores; the head 3 x T x vocab (logits, their log-softmax, its gradient);
- the model as first built: every rank builds the whole model (all experts, FP32) before it keeps its slice;
- per CPU rank, its process (torch, transformers, the Triton interpreter: ~0.4 GiB of RSS measured).

The rank's peak is the larger of the whole model as built and weights + gradients + moments + copies +
activations, plus the process. Against the max RSS of CPU ranks (1 or 2 ranks, the reference and megamoe, 5
shapes of 0.6-2.3 GiB: hidden 128-512, 8-64 experts, sequences 128-1024, vocabularies 1k-32k) it gave 0.77x to
1.15x; GPU runs are not measured against it yet. It is meant to refuse what cannot fit by far (`megamoe train
--preset h200x2 --device cpu`: ~390 GiB for the two ranks; on GPUs ~100 GiB a rank: refused on an 80 GiB H100,
run on a 141 GiB H200), not to tell 70 from 80 GiB.

:func:`available_bytes`: CPU ranks share the machine's RAM (``MemTotal`` of /proc/meminfo, or psutil's where
that file is missing); each GPU rank has its GPU's free memory (``torch.cuda.mem_get_info``, asked in a
short-lived process so that this one holds no CUDA context while the ranks train).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import dataclass

from megamoe.training.model import TrainPreset

GiB = 2**30
#: Bytes of a CPU rank's process before its model: max RSS measured 0.40-0.41 GiB on the `cpu` preset.
CPU_PROCESS_BYTES = GiB // 2
#: A GPU rank's CUDA context, kernels and allocator slack beside its tensors.
GPU_PROCESS_BYTES = GiB


def parameter_counts(preset: TrainPreset) -> tuple[int, int]:
    """(every parameter of the model, of which the routed experts') as transformers' Qwen3MoeForCausalLM holds
    them (no biases, untied embeddings, every layer sparse)."""
    d, q, kv = preset.hidden, preset.heads * preset.head_dim, preset.kv_heads * preset.head_dim
    attention = d * q + 2 * d * kv + q * d + 2 * preset.head_dim  # q, k, v, o and the q / k norms
    experts = preset.num_experts * 3 * preset.moe_intermediate * d  # gate_up [E, 2I, D] and down [E, D, I]
    layer = attention + 2 * d + preset.num_experts * d + experts  # two norms, the router
    total = 2 * preset.vocab * d + d + preset.layers * layer  # embeddings, LM head, the final norm
    return total, preset.layers * experts


def activation_elements(preset: TrainPreset, eager_attention: bool) -> int:
    """The elements one step keeps for its backward on a rank (see the module's docstring)."""
    t = preset.tokens_per_rank
    d, k, inter = preset.hidden, preset.top_k, preset.moe_intermediate
    layer = t * (6 * d + 4 * preset.heads * preset.head_dim + 4 * preset.kv_heads * preset.head_dim
                 + 2 * preset.num_experts) + t * k * (2 * d + 3 * inter)
    if eager_attention:
        layer += 3 * preset.batch * preset.heads * preset.sequence**2
    return preset.layers * layer + 3 * t * preset.vocab


@dataclass(frozen=True)
class MemoryEstimate:
    """One rank's bytes, by part (see the module's docstring)."""

    built: int  # the whole model in FP32 as every rank first builds it
    weights: int  # this rank's parameters (its slice of the experts), FP32
    gradients: int
    optimizer: int  # AdamW's two moments
    copies: int  # the rank's experts' BF16 weights and gradients and the gradients' FP32 casts
    activations: int
    process: int

    @property
    def peak(self) -> int:
        steady = self.weights + self.gradients + self.optimizer + self.copies + self.activations
        return max(self.built, steady) + self.process

    def describe(self) -> str:
        parts = (("weights", self.weights), ("gradients", self.gradients), ("AdamW state", self.optimizer),
                 ("experts' BF16 copies", self.copies), ("activations", self.activations))
        text = " + ".join(f"{name} {value / GiB:.1f}" for name, value in parts)
        return (f"{text} GiB (the whole model as first built: {self.built / GiB:.1f} GiB), plus "
                f"{self.process / GiB:.1f} GiB for the process")


def estimate(preset: TrainPreset, ranks: int, device: str) -> MemoryEstimate:
    """One rank's memory when ``ranks`` ranks train ``preset`` on ``device`` (cpu: eager attention)."""
    total, experts = parameter_counts(preset)
    my_experts = math.ceil(experts / ranks)
    mine = total - experts + my_experts
    return MemoryEstimate(built=4 * total, weights=4 * mine, gradients=4 * mine, optimizer=8 * mine,
                          copies=8 * my_experts,
                          activations=4 * activation_elements(preset, eager_attention=device == "cpu"),
                          process=CPU_PROCESS_BYTES if device == "cpu" else GPU_PROCESS_BYTES)


def _meminfo(field: str) -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name == field:
                    return int(value.split()[0]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        return None
    return None


def cpu_memory() -> tuple[int, int | None] | None:
    """(total RAM, available now or None) in bytes, or None when neither /proc/meminfo nor psutil says."""
    total = _meminfo("MemTotal")
    if total is not None:
        return total, _meminfo("MemAvailable")
    try:
        import psutil
    except ImportError:
        return None
    memory = psutil.virtual_memory()
    return memory.total, memory.available


def gpu_free_memory(count: int) -> list[int] | None:
    """Free bytes of GPUs 0 .. count-1 (``torch.cuda.mem_get_info``) from a short-lived process; None if it
    fails."""
    code = f"import json, torch; print(json.dumps([torch.cuda.mem_get_info(i)[0] for i in range({count})]))"
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                              check=False)
        return [int(v) for v in json.loads(done.stdout.strip().splitlines()[-1])] if done.returncode == 0 else None
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def check_fits(preset: TrainPreset, ranks: int, device: str) -> None:
    """ValueError saying what the run needs and what the device has when it cannot fit (nothing allocated);
    nothing when it fits or the device's memory is unknown."""
    need = estimate(preset, ranks, device)
    how = ("a rough estimate: megamoe.training.memory; to try anyway: megamoe train --no-check-memory, "
           "TrainOptions(check_memory=False)")
    if device == "cpu":
        memory = cpu_memory()
        if memory is None or ranks * need.peak <= memory[0]:
            return
        total, available = memory
        now = f", {available / GiB:.1f} GiB available now" if available is not None else ""
        raise ValueError(f"preset {preset.name} does not fit this machine's RAM: {ranks} CPU rank(s) would need "
                         f"about {ranks * need.peak / GiB:.0f} GiB ({need.peak / GiB:.1f} GiB each: "
                         f"{need.describe()}), the machine has {total / GiB:.1f} GiB{now} ({how})")
    import torch

    gpus = torch.cuda.device_count()
    if gpus == 0:
        return
    per_gpu = math.ceil(ranks / gpus)  # rank r runs on GPU r % gpus
    free = gpu_free_memory(min(ranks, gpus))
    if free is None or per_gpu * need.peak <= min(free):
        return
    raise ValueError(f"preset {preset.name} does not fit the GPUs: each of {ranks} rank(s) would need about "
                     f"{need.peak / GiB:.1f} GiB ({need.describe()})"
                     + (f", {per_gpu} ranks per GPU" if per_gpu > 1 else "")
                     + f"; the GPUs have {', '.join(f'{v / GiB:.1f}' for v in free)} GiB free ({how})")
