"""Make ``.sonic/carry/site.tar.xz``: SonicMoE and what it needs, for ``sonic_side_by_side.py`` on the GPU machine
(no network there; one carried folder of at most ~50 MiB beside the checkout).

    python3 benchmarks/sonic_carry.py [--cuda 13|12]    # here, where PyPI is reached; ~150 MB of downloads

Downloads the cp312 manylinux wheels of the pinned versions below from PyPI (``pip download --no-deps``), unpacks
them into one plain tree (what ``pip install --target`` would make), drops what the GPU run never loads (tvm_ffi's
bundled third-party sources; torch_c_dlpack_ext's .so files, built for torch <= 2.9: torch 2.11 has the DLPack C
exchange API itself) and packs the tree with xz (x86 filter, a 256 MiB dictionary: the two CuTe-DSL libraries are
one 151 MB and one 40 MB .so, already stripped, with no per-architecture cubins to cut). Nothing of it is
committed (``/.sonic/`` is ignored). On the GPU machine, run with ``carry [".sonic/carry"]``:

    S=/tmp/sonic_site; mkdir -p $S && python3 -c "import tarfile; tarfile.open('.sonic/carry/site.tar.xz').extractall('$S', filter='data')" || exit 1
    export PYTHONPATH=$PWD/src:$S:$S/nvidia_cutlass_dsl/python_packages PYTHONUNBUFFERED=1 \\
      CUTE_DSL_CACHE_DIR=/tmp/cute_dsl_cache QUACK_CACHE_DIR=/tmp/quack_cache QUACK_HOME=/tmp/quack_home \\
      QUACK_COMPILE_WORKERS=12 TVM_FFI_CACHE_DIR=/tmp/tvm_ffi_cache NCCL_NVLS_ENABLE=0 \\
      TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    python3 -c "import sonicmoe, quack, cutlass" || exit 3
    python3 benchmarks/sonic_side_by_side.py --sonic-tune off --out $OUT/sbs_untuned.json   # ~6-8 min

then, QuACK autotuned as SonicMoE runs by default (split: a first call of a shape tunes for minutes):
``--sonic-tune on --impls megamoe,sonic,sonic-tc --shapes sonic-7b,qwen3-30b-a3b`` and ``--shapes
sonic-d4096,sonic-120b``. If the CUDA-13 build (made with CUDA 13.1) fails on the image's 13.0 driver, make the
``--cuda 12`` tree (CUDA 12.9 libraries of the same release) and carry that instead.
"""

from __future__ import annotations

import argparse
import lzma
import pathlib
import shutil
import subprocess
import sys
import tarfile
import zipfile

#: sonic-moe 0.1.2.post1 pins nvidia-cutlass-dsl 4.4.2; quack-kernels 0.3.11 is the release beside it (0.5 needs
#: cutlass-dsl 4.5). Its torch pin (<= 2.9.1) is ignored: the GPU machine has torch 2.11.
WHEELS = ["sonic-moe==0.1.2.post1", "quack-kernels==0.3.11", "nvidia-cutlass-dsl==4.4.2",
          "apache-tvm-ffi==0.1.15.post2", "torch-c-dlpack-ext==0.1.5"]
LIBS = {"13": "nvidia-cutlass-dsl-libs-cu13==4.4.2", "12": "nvidia-cutlass-dsl-libs-base==4.4.2"}
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64"]


def download(names: list[str], dest: pathlib.Path) -> None:
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version",
                    "3.12", "--implementation", "cp", *platforms, "-d", str(dest), *names], check=True)


def unpack(wheels: pathlib.Path, site: pathlib.Path) -> None:
    for wheel in sorted(wheels.glob("*.whl")):
        with zipfile.ZipFile(wheel) as z:
            z.extractall(site)
    shutil.rmtree(site / "tvm_ffi" / "3rdparty", ignore_errors=True)
    for so in (site / "torch_c_dlpack_ext").glob("*.so"):
        so.unlink()


def pack(site: pathlib.Path, out: pathlib.Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    filters = [{"id": lzma.FILTER_X86}, {"id": lzma.FILTER_LZMA2, "preset": 9, "dict_size": 256 << 20}]
    with lzma.open(out, "wb", format=lzma.FORMAT_XZ, filters=filters) as f, tarfile.open(fileobj=f, mode="w") as t:
        for path in sorted(site.iterdir()):
            t.add(path, arcname=path.name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cuda", choices=sorted(LIBS), default="13")
    parser.add_argument("--root", default=".sonic")
    a = parser.parse_args()
    root = pathlib.Path(a.root)
    wheels, site = root / f"whl-cu{a.cuda}", root / f"site-cu{a.cuda}"
    download([*WHEELS, LIBS[a.cuda]], wheels)
    shutil.rmtree(site, ignore_errors=True)
    unpack(wheels, site)
    out = root / ("carry" if a.cuda == "13" else f"carry-cu{a.cuda}") / "site.tar.xz"
    pack(site, out)
    print(f"{out}: {out.stat().st_size / 2**20:.1f} MiB (carry {out.parent}, beside a checkout of ~10 MiB: <= 64 MiB)")


if __name__ == "__main__":
    main()
