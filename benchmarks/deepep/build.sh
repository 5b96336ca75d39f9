#!/usr/bin/env bash
# Build DeepEP's intranode kernels (no NVSHMEM) from the snapshot, in place, on the GPU machine, in one command;
# prints the build time. `import deep_ep` then works with the snapshot folder on PYTHONPATH.
#
#   bash benchmarks/deepep/build.sh [SRC=third_party/DeepEP]
#   PYTHONPATH=src:third_party/DeepEP python3 -m megamoe bench --impl nccl-torch,deepep-torch,megamoe ...
#
# DeepEP v1.2.1's setup.py builds the internode and low-latency kernels (NVSHMEM) whenever NVSHMEM_DIR is set or
# `nvidia.nvshmem` is importable, as it is on the GPU image; EP inside one NVLink domain needs neither, so the
# build runs setup.py with that module hidden from its probe (setup.py then defines DISABLE_NVSHMEM and compiles
# runtime.cu, layout.cu and intranode.cu only), for sm_90 (TORCH_CUDA_ARCH_LIST=9.0, its default). It still compiles
# with -rdc=true, whose device link step setup.py adds only with NVSHMEM (without it: "undefined symbol
# __cudaRegisterLinkedBinary_..." at import), so the build asks torch's CUDAExtension for that step.
set -euo pipefail
src=${1:-third_party/DeepEP}
if [ ! -f "$src/setup.py" ]; then
  echo "no DeepEP source in $src: make it with benchmarks/deepep/snapshot.sh (and carry it to this machine)" >&2
  exit 2
fi
start=$(date +%s)
(cd "$src" && env -u NVSHMEM_DIR TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=${MAX_JOBS:-8} python3 - <<'PY'
import importlib.util
import runpy
import sys

import torch.utils.cpp_extension as cpp

probe = importlib.util.find_spec
importlib.util.find_spec = lambda name, *args, **kwargs: None if name == "nvidia.nvshmem" else probe(name, *args,
                                                                                                    **kwargs)
make_extension = cpp.CUDAExtension


def intranode_extension(*args, **kwargs):
    """setup.py compiles with -rdc=true but adds the device link step only with NVSHMEM: add it."""
    flags = kwargs.get("extra_compile_args", {})
    if "-rdc=true" in flags.get("nvcc", []) and "nvcc_dlink" not in flags:
        kwargs["dlink"] = True
    return make_extension(*args, **kwargs)


cpp.CUDAExtension = intranode_extension
sys.argv = ["setup.py", "build_ext", "--inplace"]
runpy.run_path("setup.py", run_name="__main__")
PY
)
echo "DeepEP built in $(( $(date +%s) - start )) s"
PYTHONPATH="$src${PYTHONPATH:+:$PYTHONPATH}" python3 -c "import deep_ep, deep_ep_cpp; print('deep_ep imports from', deep_ep.__file__)"
