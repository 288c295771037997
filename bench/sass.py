"""The CUDA kernels' machine code, read without a GPU: per kernel of csrc/cuda/'s .cu files, ptxas's
registers and spills, and (with nvdisasm) its memory instructions by address space.

    python bench/sass.py [--source kl.cu ...] [--kernel kl_forward] [--arch sm_90]

Each source is compiled to a cubin with CMakeLists.txt's CUDA flags against this torch's headers (a CPU
wheel of torch lacks one header a CUDA build generates; it is stubbed). The counts are of instructions
in the code, not of instructions executed: they show what the compiler made of a change (e.g. generic
loads and stores, LD/ST, whose window is resolved at run time, where shared-memory ones, LDS/STS, were
meant), not what it costs. nvdisasm is taken from PATH or $NVDISASM: CUDA toolkits have it, and so does
the wheel that `pip download --no-deps nvidia-cuda-nvdisasm` fetches (unzip it; the program is its
nvidia/cu*/bin/nvdisasm). Without it only ptxas's columns are printed.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Memory instructions by address space (sm_90's opcodes: there RED is not emitted, REDG is the global
# reduction; on sm_80 RED is).
SPACES = {
    "shared": ("LDS", "STS", "LDSM", "ATOMS"),
    "global": ("LDG", "STG", "ATOMG", "RED", "REDG"),
    "generic": ("LD", "ST", "ATOM"),
    "local": ("LDL", "STL"),
}


def nvcc_flags(stub_include: Path, arch: str = "sm_90") -> list[str]:
    """CMakeLists.txt's CUDA flags for this torch's headers; stub_include holds the header a CPU wheel
    lacks (write_stub_include)."""
    import torch

    torch_include = Path(torch.__file__).parent / "include"
    return ["-std=c++20", f"-arch={arch}", "--expt-relaxed-constexpr", "-Xcompiler=-fPIC",
            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
            "-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__", "-D__CUDA_NO_BFLOAT16_CONVERSIONS__",
            "-D__CUDA_NO_HALF2_OPERATORS__", "-DKIVI_FAST_WITH_CUDA",
            "-I", str(stub_include), "-isystem", str(torch_include),
            "-isystem", str(torch_include / "torch" / "csrc" / "api" / "include"), "-I", str(ROOT / "csrc")]


def write_stub_include(directory: Path) -> Path:
    """c10/cuda/impl/cuda_cmake_macros.h, which a CUDA build of torch generates, under directory."""
    stub = directory / "c10" / "cuda" / "impl"
    stub.mkdir(parents=True, exist_ok=True)
    (stub / "cuda_cmake_macros.h").write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
    return directory


def short_name(mangled: str) -> str:
    """kl_forward_kernel<float, 1> for the mangled name of kivi_fast::cuda::(anonymous)::kl_forward_kernel<float, 1>(...)."""
    if shutil.which("c++filt") is None:
        return mangled
    full = subprocess.run(["c++filt", mangled], capture_output=True, text=True).stdout.strip()
    if full.startswith("void "):
        full = full[5:]
    depth, cut = 0, len(full)
    for i in range(len(full) - 1, -1, -1):  # the argument list: the "(" that closes at the end
        depth += full[i] == ")"
        depth -= full[i] == "("
        if depth == 0 and full[i] == "(":
            cut = i
            break
    name = full[:cut]
    bracket = name.find("<")  # the namespaces before the template arguments, not inside them
    head, tail = (name, "") if bracket < 0 else (name[:bracket], name[bracket:])
    return head.split("::")[-1] + tail


def parse_ptxas(text: str) -> dict[str, dict]:
    """Registers and spill bytes per kernel from ptxas's --resource-usage lines. (A kernel's callees get
    "Function properties" lines of their own, after the kernel's: only the kernel's spills count.)"""
    kernels, current, properties_of = {}, None, None
    for line in text.splitlines():
        m = re.search(r"Compiling entry function '([^']+)'", line)
        if m:
            current = kernels.setdefault(m.group(1), {"registers": 0, "spill_stores": 0, "spill_loads": 0})
            properties_of = None
            continue
        m = re.search(r"Function properties for (\S+)", line)
        if m:
            properties_of = m.group(1)
            continue
        if current is None:
            continue
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and properties_of is not None and properties_of in kernels:
            kernels[properties_of]["spill_stores"], kernels[properties_of]["spill_loads"] = map(int, m.groups())
        m = re.search(r"Used (\d+) registers", line)
        if m:
            current["registers"] = int(m.group(1))
    return kernels


def opcode(instruction: str) -> str:
    """LDS for '@!P5 LDS.64 R4, [R4+0x18]' (the predicate and the modifiers dropped)."""
    words = instruction.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].split(".")[0] if words else ""


def parse_nvdisasm(text: str) -> dict[str, Counter]:
    """Per kernel, its instructions counted by address space (SPACES) and in all ("instructions")."""
    space_of = {op: space for space, ops in SPACES.items() for op in ops}
    kernels, current = {}, None
    for line in text.splitlines():
        m = re.match(r"\.text\.(\S+?):?\s*$", line.strip())
        if m:
            current = kernels.setdefault(m.group(1), Counter())
            continue
        m = re.match(r"\s*/\*[0-9a-f]+\*/\s+(.*?)\s*;", line)
        if m and current is not None:
            op = opcode(m.group(1))
            current["instructions"] += 1
            if op in space_of:
                current[space_of[op]] += 1
    return kernels


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--source", nargs="+", default=None, help="files of csrc/cuda/ (default: all)")
    ap.add_argument("--kernel", default="", help="only kernels whose name contains this")
    ap.add_argument("--arch", default="sm_90")
    args = ap.parse_args(argv)
    if shutil.which("nvcc") is None:
        print("sass.py: no nvcc on PATH", file=sys.stderr)
        return 2
    sources = ([ROOT / "csrc" / "cuda" / s for s in args.source] if args.source
               else sorted((ROOT / "csrc" / "cuda").glob("*.cu")))
    for s in sources:
        if not s.is_file():
            print(f"sass.py: --source: no file {s}", file=sys.stderr)
            return 2
    nvdisasm = os.environ.get("NVDISASM") or shutil.which("nvdisasm")
    if nvdisasm is None:
        print("(no nvdisasm on PATH or in $NVDISASM: ptxas's columns only)")
    with tempfile.TemporaryDirectory() as tmp:
        flags = nvcc_flags(write_stub_include(Path(tmp) / "include"), args.arch)
        header = f"{'kernel':<44} {'regs':>5} {'spill st/ld B':>14}"
        if nvdisasm:
            header += f" {'instr':>7} {'shared':>7} {'global':>7} {'generic':>8} {'local':>6}"
        for source in sources:
            cubin = Path(tmp) / (source.stem + ".cubin")
            run = subprocess.run(["nvcc", *flags, "--resource-usage", "-cubin", str(source), "-o", str(cubin)],
                                 capture_output=True, text=True)
            if run.returncode != 0:
                print(f"sass.py: nvcc failed on {source.name}:\n{run.stderr[-4000:]}", file=sys.stderr)
                return 1
            usage = parse_ptxas(run.stdout + run.stderr)
            spaces = {}
            if nvdisasm:
                spaces = parse_nvdisasm(subprocess.run([nvdisasm, str(cubin)], capture_output=True, text=True,
                                                       check=True).stdout)
            print(f"\n{source.relative_to(ROOT)} ({args.arch})\n{header}")
            for mangled, u in usage.items():
                name = short_name(mangled)
                if args.kernel not in name:
                    continue
                row = f"{name:<44} {u['registers']:>5} {u['spill_stores']:>6}/{u['spill_loads']:<7}"
                if nvdisasm:
                    c = spaces.get(mangled, Counter())
                    row += (f" {c['instructions']:>7} {c['shared']:>7} {c['global']:>7} {c['generic']:>8}"
                            f" {c['local']:>6}")
                print(row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
