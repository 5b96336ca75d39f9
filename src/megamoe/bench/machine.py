"""What a `megamoe bench` record says about where it ran, and the physical floor of a pass's time.

:func:`machine_info`: the device (name, count), the GPU driver and power limit (``nvidia-smi``), torch and
Triton versions, the commit of the checkout the package runs from and whether it had changes, and the run's
``MEGAMOE_*`` knobs (:func:`knobs`).
:class:`ClockSample`: the SM clock of each GPU used, asked for as a round starts and read after the rounds.
:func:`floor_ms`: the time a pass cannot beat on an H200: its FLOPs at the sustained dense rate, or its
cross-rank bytes at the NVLink rate, whichever is longer. Every field is None where it is not known
(CPU runs, no ``nvidia-smi``, not a git checkout, a GPU without measured rates).
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess

import torch

#: Sustained dense FLOP/s of one H200 at its 700 W power cap, measured in interleaved steady-state rounds on
#: kimi-k2's expert shapes (benchmarks/results/2026-12-01-gemm-vs-dense): BF16 cuBLAS ``torch.mm`` reached
#: 656 TFLOP/s (gate/up, [65536 x 7168] x [7168 x 4096]), FP8 ``torch._scaled_mm`` with row/column scales 1189.
H200_BF16_FLOPS = 656e12
H200_FP8_FLOPS = 1189e12
#: Cross-rank bytes per second per direction per H200 over NVLink: the pull dispatch copy at 132 SMs, 335 GB/s
#: (benchmarks/results/2026-11-30-tile-order; the peer ``copy_`` of the same run reached 372-373).
H200_NVLINK_BYTES_PER_S = 335e9
#: The routed experts' dense rate by format (mxfp8's block scales are taken at the FP8 rate).
H200_EXPERT_FLOPS = {"bf16": H200_BF16_FLOPS, "fp8-block": H200_FP8_FLOPS, "mxfp8": H200_FP8_FLOPS}
NVIDIA_SMI_TIMEOUT_S = 10


def floor_ms(device_name: str | None, precision: str, experts: str, flops: float, routed_flops: float,
             cross_bytes: float) -> float | None:
    """One rank's floor in ms: max(FLOPs / dense rate, cross-rank bytes / link rate), the routed experts'
    FLOPs at the rate of their format and the rest (shared experts) at BF16's. None off an H200 or for a
    precision other than bf16 (no measured rate)."""
    if not device_name or "H200" not in device_name or precision != "bf16" or experts not in H200_EXPERT_FLOPS:
        return None
    compute_s = (flops - routed_flops) / H200_BF16_FLOPS + routed_flops / H200_EXPERT_FLOPS[experts]
    return max(compute_s, cross_bytes / H200_NVLINK_BYTES_PER_S) * 1e3


def git_commit() -> tuple[str | None, bool | None]:
    """(HEAD's 40-hex commit, whether ``git status --porcelain`` lists anything) of the checkout this package
    runs from; (None, None) when it is not a tracked file of a git checkout (an installed copy, a copy of the
    tree without .git). ``MEGAMOE_COMMIT``, when set, is the commit of such a copy (dirty unknown: None)."""
    if os.environ.get("MEGAMOE_COMMIT"):
        return os.environ["MEGAMOE_COMMIT"], None
    here = os.path.dirname(os.path.abspath(__file__))
    package_init = os.path.join(os.path.dirname(here), "__init__.py")

    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", *args], cwd=here, capture_output=True, text=True, timeout=10)

    try:
        # the package's own file tracked: not an installed copy inside some other checkout (a venv in the repo)
        if git("ls-files", "--error-unmatch", package_init).returncode != 0:
            return None, None
        head = git("rev-parse", "HEAD")
        status = git("status", "--porcelain")
    except (OSError, subprocess.SubprocessError):
        return None, None
    commit = head.stdout.strip()
    if head.returncode != 0 or len(commit) != 40 or status.returncode != 0:
        return None, None
    return commit, bool(status.stdout.strip())


def _visible_gpu_ids() -> str | None:
    """``nvidia-smi -i``'s list for CUDA_VISIBLE_DEVICES (indices or UUIDs), None for every GPU."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    return visible or None


def nvidia_smi(fields: str) -> list[list[str]] | None:
    """``nvidia-smi --query-gpu=FIELDS --format=csv,noheader,nounits``: one row of values per visible GPU;
    None when it is absent, fails or times out."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    cmd = [exe, f"--query-gpu={fields}", "--format=csv,noheader,nounits"]
    ids = _visible_gpu_ids()
    if ids is not None:
        cmd.append(f"--id={ids}")
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError):
        return None
    rows = [[v.strip() for v in line.split(",")] for line in done.stdout.splitlines() if line.strip()]
    return rows if done.returncode == 0 and rows else None


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:  # "[N/A]", "[Not Supported]"
        return None


def sm_clocks_mhz(device: str) -> list[float] | None:
    """The SM clock of each visible GPU now, MHz (None on the CPU or without nvidia-smi)."""
    return ClockSample(device).result()


class ClockSample:
    """The SM clock of each visible GPU, asked of ``nvidia-smi`` when made and read by :meth:`result`: it runs
    beside the work in between (the timed rounds sample the clock while they run, not while the GPU waits)."""

    def __init__(self, device: str):
        self.proc = None
        exe = shutil.which("nvidia-smi") if device == "cuda" else None
        if exe is None:
            return
        cmd = [exe, "--query-gpu=clocks.sm", "--format=csv,noheader,nounits"]
        ids = _visible_gpu_ids()
        if ids is not None:
            cmd.append(f"--id={ids}")
        try:
            self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError:
            self.proc = None

    def result(self) -> list[float] | None:
        if self.proc is None:
            return None
        try:
            out, _ = self.proc.communicate(timeout=NVIDIA_SMI_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.communicate()
            return None
        if self.proc.returncode != 0:
            return None
        clocks = [_number(line.split(",")[0].strip()) for line in out.splitlines() if line.strip()]
        return [c for c in clocks if c is not None] or None


def knobs() -> dict[str, str]:
    """The ``MEGAMOE_*`` environment variables set for the run (its A/B switches and knobs, read at import), but
    ``MEGAMOE_COMMIT`` (the record's commit): what a reproducing command needs besides its arguments."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith("MEGAMOE_") and k != "MEGAMOE_COMMIT"}


def machine_info(device: str) -> dict:
    """The fields every record of a run carries about its machine and code (see the module docstring)."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    commit, dirty = git_commit()
    info = {"device_name": platform.processor() or "cpu", "device_count": os.cpu_count(), "driver_version": None,
            "power_limit_w": None, "torch": torch.__version__, "triton": triton_version, "commit": commit,
            "dirty": dirty, "knobs": knobs()}
    if device == "cuda":
        info["device_name"], info["device_count"] = torch.cuda.get_device_name(0), torch.cuda.device_count()
        rows = nvidia_smi("driver_version,power.limit")
        if rows:
            info["driver_version"] = rows[0][0]
            limits = [v for v in (_number(r[1]) for r in rows if len(r) > 1) if v is not None]
            info["power_limit_w"] = min(limits) if limits else None  # the cap that binds the slowest GPU
    return info


def clock_range(samples: list[list[float] | None]) -> list[float] | None:
    """[lowest, highest] SM clock over every GPU's samples, None if none was taken."""
    seen = [c for sample in samples if sample for c in sample]
    return [min(seen), max(seen)] if seen else None
