"""tools/offline_compile.py's SASS counting (--sass) on a listing in nvdisasm's format: the compile itself needs
the CUDA toolkit, which CI does not have."""

import os
from collections import Counter

LISTING = """
        .text.k:
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   S2R R0, SR_TID.X ;
.L_x_0:
        /*0020*/                   IMAD.WIDE.U32 R2, R0, 0x4, R4 ;
        /*0030*/              @!P0 LDG.E R6, desc[UR4][R2.64] ;
        /*0040*/                   FFMA R7, R6, R6, R7 ;
.L_x_1:
        /*0050*/               @P1 FFMA R8, R7, R7, R8 ;
        /*0060*/                   ISETP.NE.AND P1, PT, R0, RZ, PT ;
        /*0070*/               @P1 BRA `(.L_x_1) ;
        /*0080*/                   ISETP.GE.U32.AND P0, PT, R0, 0x10, PT ;
        /*0090*/              @!P0 BRA `(.L_x_0) ;
        /*00a0*/                   BRA `(.L_x_2) ;
.L_x_2:
        /*00b0*/                   EXIT ;
"""


def test_count_sass_counts_the_kernel_and_each_loop_by_opcode(monkeypatch):
    # the tool drops NUMBA_ENABLE_CUDASIM from the environment when imported (it compiles for a real GPU):
    # monkeypatch puts the variable back for the tests after this one (and their subprocesses)
    monkeypatch.setenv("NUMBA_ENABLE_CUDASIM", os.environ.get("NUMBA_ENABLE_CUDASIM", "0"))
    from tools.offline_compile import count_sass

    total, loops = count_sass(LISTING.splitlines())
    assert total == Counter({"MOV": 1, "S2R": 1, "IMAD": 1, "LDG": 1, "FFMA": 2, "ISETP": 2, "BRA": 3, "EXIT": 1})
    # the inner loop ends first; a forward branch (to .L_x_2) makes no loop
    assert loops == [Counter({"FFMA": 1, "ISETP": 1, "BRA": 1}),
                     Counter({"IMAD": 1, "LDG": 1, "FFMA": 2, "ISETP": 2, "BRA": 2})]
