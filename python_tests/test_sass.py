"""bench/sass.py's reading of ptxas's and nvdisasm's output (excerpts of real output for sm_90; no
nvdisasm is needed here). test_backend.py's nvcc test reads ptxas's report of every kernel with it."""

import shutil

import pytest

from conftest import bench_module

sass = bench_module("sass")
demangles = pytest.mark.skipif(shutil.which("c++filt") is None, reason="no c++filt (binutils) on this machine")

FORWARD = "_ZN9kivi_fast4cuda37_GLOBAL__N__f1de0c17_5_kl_cu_6ab3b21a17kl_forward_kernelIfLi2EEEvPKT_S5_PKdPdS8_PS3_S8_S8_S8_NS1_6KlArgsE"
FIT = "_ZN9kivi_fast4cuda37_GLOBAL__N__f1de0c17_5_kl_cu_6ab3b21a15fit_coef_kernelEPKdPKiS3_lldPd"

PTXAS = f"""ptxas info    : Compiling entry function '{FORWARD}' for 'sm_90'
ptxas info    : Function properties for {FORWARD}
    48 bytes stack frame, 64 bytes spill stores, 92 bytes spill loads
ptxas info    : Used 64 registers, used 1 barriers, 48 bytes cumulative stack size, 12544 bytes smem
ptxas info    : Compiling entry function '{FIT}' for 'sm_90'
ptxas info    : Function properties for {FIT}
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 26 registers, used 0 barriers
ptxas info    : Function properties for _Z6calleePd
    8 bytes stack frame, 8 bytes spill stores, 8 bytes spill loads
"""

NVDISASM = f"""	.section	.text.{FORWARD},"ax",@progbits
.text.{FORWARD}:
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*13ad0*/              @!P5 LD.E.64 R70, desc[UR14][R72.64] ;
        /*13980*/                   LDS.128 R32, [R71+-0x8] ;
        /*13960*/              @!P1 STS [R62+0x30f8], R63 ;
        /*14090*/               @P1 ST.E.64 desc[UR14][R74.64], R94 ;
        /*0f70*/                   LDG.E.CONSTANT R16, desc[UR12][R14.64] ;
        /*0f80*/                   STL.64 [R1+0x10], R4 ;
.L_x_1169:
        /*0f90*/                   ATOMS.POPC.INC.32 RZ, [R3+URZ] ;
//--------------------- .text.{FIT} --------------------------
.text.{FIT}:
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0050*/                   IMAD.WIDE.U32 R2, R0, 0x4, R2 ;
        /*1070*/               @P1 LDG.E.CONSTANT R18, desc[UR12][R14.64+0x100] ;
"""


def test_ptxas_registers_and_spills_per_kernel():
    # (a callee's properties, printed after its kernel's, are not the kernel's)
    usage = sass.parse_ptxas(PTXAS)
    assert usage == {FORWARD: {"registers": 64, "spill_stores": 64, "spill_loads": 92},
                     FIT: {"registers": 26, "spill_stores": 0, "spill_loads": 0}}


@demangles
def test_kernel_names_keep_their_template_arguments_whole():
    assert sass.short_name(FORWARD) == "kl_forward_kernel<float, 2>"
    assert sass.short_name(FIT) == "fit_coef_kernel"
    # void kivi_fast::k<c10::Half>(c10::Half const*)
    assert sass.short_name("_ZN9kivi_fast1kIN3c104HalfEEEvPKT_") == "k<c10::Half>"


def test_nvdisasm_memory_instructions_by_address_space():
    counts = sass.parse_nvdisasm(NVDISASM)
    assert set(counts) == {FORWARD, FIT}
    forward = counts[FORWARD]
    assert (forward["instructions"], forward["generic"], forward["shared"], forward["global"], forward["local"]) == \
        (8, 2, 3, 1, 1)
    assert (counts[FIT]["instructions"], counts[FIT]["global"], counts[FIT]["shared"]) == (3, 1, 0)
    assert sass.opcode("@!P5 LD.E.64 R70, desc[UR14][R72.64]") == "LD"
