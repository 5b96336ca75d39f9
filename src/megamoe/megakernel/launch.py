"""Launching the forward megakernel: its arguments, its co-residency check and the phased CPU mode.

:class:`Launcher` holds what every launch of one :class:`~megamoe.megakernel.kernel.MegaKernel` shares (tiles,
constexprs, the counters' views, descriptors of the kernel's own buffers), builds a launch's arguments in their
named groups (:mod:`megamoe.megakernel.launch_args`) and runs it: on a GPU the whole pass as one launch,
on the CPU in phases.

Phased mode (the interpreter runs programs one after another, so programs cannot wait for each other): the
same kernel code, one step of one role per launch, sequenced by the host in the order the waits would impose
(shared expert, then per visited minibatch: the push of the minibatch leaving its ring slot, the pull, gate/up,
down; then the pushes of the minibatches still in the ring). Each tile is computed by the same code on the same
rows either way: the bits are the same.
"""

from __future__ import annotations

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from megamoe.kernels import megakernel as mk
from megamoe.megakernel.buffers import LayerBuffers
from megamoe.megakernel.launch_args import (CommArgs, PassEndArgs, RoutedArgs, RowTileArgs, ScaleArgs, ScheduleArgs,
                                            SharedArgs, SizeArgs, SyncArgs, check_order, copy_tile_consts, ordered)
from megamoe.ops.launch import flat_row_stride
from megamoe.ops.quant import soft_e4m3_default
from megamoe.planner.tiles import tile_stages
from megamoe.planner.tuning import COMM_TUNING
from megamoe.runtime import interpreting

check_order()  # the groups must be the kernel's signature: fail at import, not at a launch

class Launcher:
    """One MegaKernel's launches (see the module docstring)."""

    def __init__(self, kernel) -> None:
        self.kernel = kernel
        k, s, c = kernel, kernel.shape, kernel.config
        self.routed_tiles = gate_up, down = k.tiles()
        self.shared_tiles = shared_gate_up, shared_down = k.tiles(routed=False)
        self.desc = TensorDescriptor.from_tensor
        bm, sbk = c.tile_m, shared_gate_up.block_k
        if s.shared_intermediate:
            self.shared_x_desc = self.desc(k.sym.local("x"), [bm, sbk])
        M, T = k.max_batches, k.max_tiles
        cnt = k.counters
        self.rows_ready, self.y_done = cnt[:M], cnt[M: 2 * M]
        self.tile_done, self.shared_done, self.comm_done = cnt[2 * M: 2 * M + T], cnt[2 * M + T: -1], cnt[-1:]
        if k.quantized:  # E4M3 rows and their scales
            x_q, x_scale = k.sym.local("x_q"), k.sym.local("x_scale")
            self.pulled = (k.sym.peer_ptrs("x_q"), x_q, x_q.stride(0), k.sym.peer_ptrs("x_scale"), x_scale,
                           x_scale.stride(0))
            scale_rows = (x_scale.shape[1], x_scale.element_size())
        else:  # BF16 rows; the scales are never read
            x_sym = k.sym.local("x")
            self.pulled = (k.sym.peer_ptrs("x"), x_sym, x_sym.stride(0), k.sym.peer_ptrs("x"), x_sym, 0)
            scale_rows = None
        self.consts = dict(
            TOP_K=s.top_k, DOT_FP32=interpreting(),
            FENCE=k.gpu, BLOCK_M=bm, BN_GU=gate_up.block_n, BN_DN=down.block_n, BLOCK_K=gate_up.block_k,
            GROUP_GU=gate_up.group_m, GROUP_DN=down.group_m, TRACE=k.trace is not None and k.gpu,
            FMT=k.fmt, SOFT_E4M3=soft_e4m3_default(),
            SHARED_BN_GU=shared_gate_up.block_n, SHARED_BN_DN=shared_down.block_n, SHARED_BK=sbk,
            **copy_tile_consts(s.hidden, k.scale_block, scale_rows, k.tuning.comm or COMM_TUNING),
            num_warps=gate_up.num_warps, num_stages=k.tuning.megakernel_stages or tile_stages(s),
        )
        self.checked_occupancy = False

    def _descs_of(self, buffers: LayerBuffers) -> tuple:
        """TMA descriptors over a layer's ring rows, activation and shared activation (host objects, made per
        launch: a cache would keep the layer's buffers alive)."""
        bm, bk, sbk = self.kernel.config.tile_m, self.routed_tiles[0].block_k, self.shared_tiles[0].block_k
        shared = self.desc(buffers.shared_act, [bm, sbk]) if buffers.shared_act is not None else None
        return self.desc(buffers.ring_x, [bm, bk]), self.desc(buffers.act, [bm, bk]), shared

    def arguments(self, n, schedule, tiles, buffers: LayerBuffers, w_gate_up, w_down, experts_q, shared,
                  activation, b_gate_up=None, b_down=None) -> tuple[tuple, dict]:
        """(runtime arguments without the step index, constexprs) of one pass (``b_gate_up``, ``b_down``: the
        routed experts' optional biases)."""
        k, s, c = self.kernel, self.kernel.shape, self.kernel.config
        (gate_up_tile, down_tile), (shared_gate_up, shared_down) = self.routed_tiles, self.shared_tiles
        D, I, L = s.hidden, s.intermediate, s.experts_per_rank
        bk, sbk = gate_up_tile.block_k, shared_gate_up.block_k
        ring_desc, act_desc, shared_act_desc = self._descs_of(buffers)
        if k.quantized:  # experts_q: from the caller (once per optimizer step) or from forward, before this
            q = experts_q
            w_gate_up, w_down = q.w_gate_up, q.w_down
            scales = ScaleArgs(buffers.ring_scale, q.w_gate_up_scale, buffers.act_scale, q.w_down_scale,
                               buffers.ring_scale.stride(0), flat_row_stride(q.w_gate_up_scale),
                               buffers.act_scale.stride(0), flat_row_stride(q.w_down_scale))
        else:  # never read
            scales = ScaleArgs(k.error, k.error, k.error, k.error, 0, 0, 0, 0)
        w_gu_desc = self.desc(w_gate_up.view(L * 2 * I, D), [gate_up_tile.block_n, bk])
        w_dn_desc = self.desc(w_down.view(L * D, I), [down_tile.block_n, bk])
        if shared is not None:
            shared_args = SharedArgs(self.shared_x_desc, self.desc(shared[0], [shared_gate_up.block_n, sbk]),
                                     buffers.shared_h, buffers.shared_act, buffers.shared_h.stride(0),
                                     buffers.shared_act.stride(0), shared_act_desc,
                                     self.desc(shared[1], [shared_down.block_n, sbk]), k.shared_y,
                                     k.shared_y.stride(0))
        else:  # never read (HAS_SHARED=False)
            shared_args = SharedArgs(ring_desc, w_gu_desc, buffers.h, buffers.act, 0, 0, act_desc, w_dn_desc, k.y, 0)
        combine = k.sym.local("combine")
        bytes_view = (lambda t: t.view(torch.uint8)) if k.quantized else (lambda t: t)
        args = ordered(
            ScheduleArgs(schedule.num_rows, schedule.src_rank, schedule.src_index),
            RowTileArgs.of(tiles),
            CommArgs(*self.pulled, bytes_view(buffers.ring_x), buffers.ring_x.stride(0),
                     k.sym.peer_ptrs("combine"), combine, combine.stride(0)),
            RoutedArgs(ring_desc, w_gu_desc, buffers.h, bytes_view(buffers.act), buffers.h.stride(0),
                       buffers.act.stride(0), act_desc, w_dn_desc, k.y, k.y.stride(0), b_gate_up, b_down),
            scales,
            shared_args,
            SyncArgs(self.rows_ready, self.tile_done, self.y_done, self.shared_done),
            PassEndArgs.of(k, self.comm_done),
            SizeArgs(n, k.world.rank, k.world.size, c.comm_sms, c.minibatch, c.ring_rows // c.minibatch, L, I, D,
                     s.shared_intermediate, activation.kernel_limit, activation.kernel_alpha, k.budget),
        )
        consts = dict(self.consts, HAS_SHARED=shared is not None, ACT=activation.kernel_id)
        return args, consts

    def run(self, schedule, args: tuple, consts: dict) -> None:
        """The pass: one launch of the whole grid on a GPU (its steps one after another with
        ``KernelConfig.overlap`` off), the phased steps on the CPU."""
        c = self.kernel.config
        if self.kernel.gpu and c.overlap:
            if not self.checked_occupancy:
                self.check_occupancy(args, consts)
            mk.megakernel[(c.num_sms,)](*args, 0, PHASE=mk.PHASE_ALL.value, **consts)
        else:
            self.run_phased(schedule, args, consts)

    def run_phased(self, schedule, args: tuple, consts: dict) -> None:
        """The pass's steps one launch each, in an order that needs no wait: the CPU mode, and on a GPU the
        no-overlap ablation, there with every compute step on every SM and a step for each minibatch the
        schedule could hold (the empty ones return at once: the row count is not read on the host)."""
        c, gpu = self.kernel.config, self.kernel.gpu
        compute = c.num_sms if gpu else c.num_sms - c.comm_sms

        def step(phase: int, programs: int, j: int = 0) -> None:
            mk.megakernel[(programs,)](*args, j, PHASE=phase, **consts)

        if consts["HAS_SHARED"]:
            step(mk.PHASE_SHARED_GATE_UP.value, compute)
            step(mk.PHASE_SHARED_DOWN.value, compute)
        if gpu:
            batches = max(1, -(-schedule.capacity // c.minibatch))  # the row tiles' minibatch count
        else:  # the CPU: reading it costs nothing
            batches = -(-int(schedule.num_rows) // c.minibatch)
        slots = c.ring_rows // c.minibatch
        for p in range(batches):
            j = batches - 1 - p
            if p >= slots:
                step(mk.PHASE_PUSH.value, c.comm_sms, j + slots)
            step(mk.PHASE_PULL.value, c.comm_sms, j)
            step(mk.PHASE_GATE_UP.value, compute, j)
            step(mk.PHASE_DOWN.value, compute, j)
        for p in range(max(batches - slots, 0), batches):
            step(mk.PHASE_PUSH.value, c.comm_sms, batches - 1 - p)

    def check_occupancy(self, args: tuple, consts: dict) -> None:
        """Refuse a grid whose programs cannot all be resident at once (they would wait on each other forever)."""
        k = self.kernel
        compiled = mk.megakernel.warmup(*args, 0, PHASE=mk.PHASE_ALL.value, grid=(k.config.num_sms,), **consts)
        check_resident(compiled, consts["num_warps"], k.world.device, "the megakernel")
        self.checked_occupancy = True


def check_resident(compiled, num_warps: int, device: torch.device, what: str) -> None:
    """ValueError unless one program of ``compiled`` fits an SM (registers and shared memory): a persistent grid
    whose programs wait for each other must be resident all at once."""
    compiled._init_handles()  # loads the module: fills n_regs
    props = torch.cuda.get_device_properties(device)
    threads = 32 * num_warps
    regs = compiled.n_regs * threads
    smem = compiled.metadata.shared
    if regs > props.regs_per_multiprocessor or smem > props.shared_memory_per_multiprocessor:
        raise ValueError(f"{what} needs {compiled.n_regs} registers x {threads} threads and {smem} B of shared "
                         f"memory per program: one program per SM does not fit")
