"""The Hopper (sm_90) build check: every kernel compiled on a machine without a GPU, and what its code holds.

    python -m megamoe.tools.sm90 [gemm] [fp8] [mxfp8] [quant] [megakernel] [backward] [bias]

prints one JSON line ``{group: {case: facts}}`` for the groups named (all of
them by default). A case is one launch as the library makes it on an H200
(:mod:`megamoe.tools.sm90_cases`): the same kernel, constexprs and JIT
specialisation — every pointer 16-byte aligned and every integer a multiple
of 16 except the kernel's ``do_not_specialize`` arguments, which is what a
launch with our sizes and strides gets (without those hints every global
store compiles to 2-byte accesses, so the check would not see what runs).

Facts (:func:`facts`): wgmma and its operand types, TMA bulk copies,
async-proxy fences, shared memory, local memory, registers and ptxas spill
bytes (cuobjdump), vector widths of global loads and stores, and for the
quantisers the stack-pointer reads that betrayed a ptxas miscompile
(:func:`stack_pointer_facts`). The tests run this in a subprocess (the
interpreter must be off to compile).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile

import triton

from megamoe.runtime import interpreting

GROUPS = ("gemm", "fp8", "mxfp8", "quant", "megakernel", "backward", "bias")


def cases(group: str) -> dict:
    """The :class:`~megamoe.tools.sm90_cases.Case` of each kernel of ``group``: the expert kernels' groups are
    in :mod:`megamoe.tools.sm90_cases`, the megakernels' in :mod:`megamoe.tools.sm90_megakernel_cases`, the expert
    biases' (every kernel that adds or reduces them) in :mod:`megamoe.tools.sm90_bias_cases`."""
    from megamoe.tools import sm90_bias_cases as biases, sm90_cases as experts, sm90_megakernel_cases as megakernels

    builders = {"gemm": experts.gemm_cases, "fp8": experts.fp8_cases, "mxfp8": experts.mxfp8_cases,
                "quant": experts.quant_cases, "megakernel": megakernels.megakernel_cases,
                "backward": megakernels.backward_cases, "bias": biases.bias_cases}
    if group not in builders:
        raise ValueError(f"unknown group {group!r}")
    return builders[group]()


def compile_sm90(kernel, signature: dict, constexprs: dict, *, num_warps: int = 8, num_stages: int = 3,
                 attrs: dict | None = None):
    """``kernel`` (Triton or Gluon) compiled for sm_90 from ``signature`` ({argument: type}) and ``constexprs``.

    ``attrs`` (the JIT's specialisation) defaults to a launch's with our sizes: 16-divisibility on every
    pointer and i32 the kernel specialises. Arguments ``signature`` leaves out that have a default (an optional
    bias pointer's None) are compiled at it. Returns Triton's compiled kernel (``.asm``: ttgir, ptx, cubin, sass;
    ``.metadata.shared``)."""
    if interpreting():
        raise RuntimeError("unset TRITON_INTERPRET to compile for sm_90")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.experimental.gluon._runtime import GluonASTSource, GluonJITFunction

    defaults = {p.name: p.default for p in kernel.params if p.has_default and p.name not in signature}
    constexprs = {**defaults, **constexprs}
    signature = {name: signature.get(name, "constexpr") if name in defaults else signature[name]
                 for name in kernel.arg_names}
    consts = {name: value for name, value in constexprs.items() if name in signature}
    if attrs is None:
        plain = {kernel.arg_names[p.num] for p in kernel.params if p.do_not_specialize}
        attrs = {(i,): [["tt.divisibility", 16]] for i, (name, kind) in enumerate(signature.items())
                 if name not in plain and name not in consts and (kind.startswith("*") or kind == "i32")}
    source = GluonASTSource if isinstance(kernel, GluonJITFunction) else ASTSource
    return triton.compile(source(fn=kernel, signature=signature, constexprs=consts, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "num_stages": num_stages})


def resource_usage(cubin: bytes) -> dict:
    """{"registers", "stack_bytes"} from cuobjdump (Triton's bundled one); ptxas spills show as stack bytes."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        try:
            text = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
        except OSError:
            return {"registers": None, "stack_bytes": None}
    reg, stack = re.search(r"REG:(\d+)", text), re.search(r"STACK:(\d+)", text)
    return {"registers": int(reg.group(1)) if reg else None, "stack_bytes": int(stack.group(1)) if stack else None}


def reduce_layouts(ttgir: str) -> list[str]:
    """The register layouts the build's reductions (``tt.reduce``) run in, per thread and warp (``warpsPerCTA``
    left out: kernels of 4 and 8 warps compare), with their axis: a row sum reduces in the same order, so to the same
    bits, where these agree."""
    aliases = dict(re.findall(r"^(#\w+) = (.*)$", ttgir, re.M))
    found = set()
    reduce = r'"tt\.reduce"\([^)]*\) <\{axis = (\d+) : i32\}>.*?\}\) : \(tensor<[^,]*, (#[\w.]+(?:<.*?>)?)>\)'
    for axis, layout in re.findall(reduce, ttgir, re.S):
        layout = aliases.get(layout, layout)
        found.add(f"axis {axis}: " + re.sub(r",? ?warpsPerCTA = \[[\d, ]*\],?", ",", layout).replace("{,", "{"))
    return sorted(found)


def facts(compiled) -> dict:
    """What one sm_90 build holds: tensor-core and copy instructions, memory, vector widths."""
    ptx = compiled.asm["ptx"]
    sass = compiled.asm.get("sass", "") or ""
    return {
        "wgmma": ptx.count("wgmma.mma_async"),
        "wgmma_bf16": "wgmma.mma_async" in ptx and ".bf16.bf16" in ptx,
        "wgmma_fp8": "wgmma.mma_async" in ptx and ".e4m3.e4m3" in ptx,
        "tma": "cp.async.bulk.tensor" in ptx,
        "cp_async": ptx.count("cp.async.cg.shared.global"),  # 16-byte row pieces by index (kernels/gluon_gather.py)
        "fence_proxy_async": "fence.proxy.async" in ptx,
        "shared_bytes": compiled.metadata.shared,
        "local_memory": "ld.local" in ptx or "st.local" in ptx or "STL" in sass,
        # narrow stores and loads of bf16 rows (the combine stores cross NVLink: 2-byte writes there cost ms;
        # alignment hints placed on 1-D row offsets alone compile to 2-byte peer loads)
        "stores_b16": ptx.count("st.global.b16"),
        "stores_v4": ptx.count("st.global.v4"),
        "loads_b16": len(re.findall(r"ld\.global(?:\.\w+)*\.b16", ptx)),
        "loads_v4": ptx.count("ld.global.v4"),
        "barriers": ptx.count("bar.sync"),
        "reduce_layouts": reduce_layouts(compiled.asm["ttgir"]),
        **resource_usage(compiled.asm["cubin"]),
    }


def _ptx_undefined_registers(ptx: str) -> list[str]:
    """PTX virtual registers that are read but never written: LLVM's undef/poison lanes (bytes a
    later ``prmt`` overwrites). ptxas may read any physical register for them, R1 included."""
    reg = re.compile(r"%[a-z]+\d+")
    defined: set[str] = set()
    read: set[str] = set()
    for line in ptx.splitlines():
        line = line.split("//", 1)[0].strip()
        if not line.endswith(";") or line.startswith("."):
            continue
        line = re.sub(r"^@!?%p\d+\s+", "", line[:-1])
        op, _, operands = line.partition(" ")
        operands = operands.strip()
        if op.startswith(("st.", "bar.", "red.", "bra", "ret", "prefetch")):
            read.update(reg.findall(operands))
            continue
        if operands.startswith("{"):
            dst, _, src = operands[1:].partition("}")
        else:
            dst, _, src = operands.partition(",")
        defined.update(reg.findall(dst))
        read.update(reg.findall(src))
    return sorted(read - defined)


def stack_pointer_facts(compiled) -> dict:
    """The quantisers' build: stack-pointer reads and what they stand for.

    ``stack_pointer_reads`` counts SASS instructions other than the prologue's ``LDC R1,
    c[0x0][0x28]`` that read R1, the stack pointer. These kernels use no stack, so such a read
    can only stand for a PTX register that is never written (``ptx_undefined_registers``: bytes
    of a packed vector that a later ``prmt`` overwrites, harmless); with none of those, it is a
    ptxas miscompile (``suspect``). The ptxas bundled with Triton 3.6 (12.8) produced exactly that for
    the old byte-level ``fp8 | sign`` of the software E4M3 path, and transposed stores wrote the
    pointer's byte 0xFC for ~20% of the elements on an H200. ``data_stores_16b`` counts 16-byte
    global stores (the data tile; scales are narrower)."""
    sass = [line.split("\t", 1)[-1].strip() for line in compiled.asm["sass"].splitlines()[1:]]
    sass = [line for line in sass if line and not line.startswith("NOP")]
    r1 = re.compile(r"(?<![\w.])R1(?!\w)")
    sp_reads = []
    for ins in sass:
        ins = re.sub(r"^@!?U?P\w+\s+", "", ins)  # guard predicate
        operands = ins.split(" ", 1)[1] if " " in ins else ""
        if re.match(r"R1\b", operands):  # R1 as the destination: skip it, look at the sources
            operands = operands.split(",", 1)[1] if "," in operands else ""
        if r1.search(operands):
            sp_reads.append(ins)
    ptx = compiled.asm["ptx"]
    undefined = _ptx_undefined_registers(ptx)
    return {
        "sass_instructions": len(sass),
        "stack_pointer_reads": len(sp_reads),
        "stack_pointer_read_example": sp_reads[0] if sp_reads else None,
        "ptx_undefined_registers": len(undefined),
        "suspect": bool(sp_reads) and not undefined,
        "data_stores_16b": ptx.count("st.global.v4.b32"),
        "barriers": ptx.count("bar.sync"),
        "shared_bytes": compiled.metadata.shared,
        "local_memory": "ld.local" in ptx or "st.local" in ptx or any(i.startswith(("STL", "LDL")) for i in sass),
    }


def check_case(case) -> dict:
    """Compile one :class:`~megamoe.tools.sm90_cases.Case` and read its facts."""
    compiled = compile_sm90(case.kernel, case.signature, case.constexprs, num_warps=case.num_warps,
                            num_stages=case.num_stages, attrs=case.attrs)
    out = facts(compiled)
    if case.stack_pointer:
        out.update(stack_pointer_facts(compiled))
    return {**case.notes, **out}


def _checked(key: tuple[str, str]) -> tuple:
    """Compile case ``key = (group, name)`` (cases are rebuilt in each worker: kernels do not pickle)."""
    group, name = key
    return key, check_case(cases(group)[name])


def report(groups: tuple[str, ...] = GROUPS, processes: int | None = None) -> dict[str, dict[str, dict]]:
    """{group: {case: facts}} for ``groups``, compiled in parallel processes."""
    from concurrent.futures import ProcessPoolExecutor

    unknown = set(groups) - set(GROUPS)
    if unknown:
        raise ValueError(f"groups must be among {GROUPS}, got {sorted(unknown)}")
    items = [(group, name) for group in groups for name in cases(group)]
    processes = processes or min(8, os.cpu_count() or 1)
    if processes <= 1:
        done = [_checked(item) for item in items]
    else:
        with ProcessPoolExecutor(processes) as pool:
            done = list(pool.map(_checked, items))
    out: dict[str, dict[str, dict]] = {group: {} for group in groups}
    for (group, name), result in done:
        out[group][name] = result
    return out


if __name__ == "__main__":
    chosen = tuple(sys.argv[1:]) or GROUPS
    print(json.dumps(report(chosen)))
