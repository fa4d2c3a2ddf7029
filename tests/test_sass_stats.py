"""tools/sass_stats.py's parsing of ptxas and cuobjdump output, on canned text (the tool itself
needs nvcc and the CUTLASS headers, which CI does not have)."""
from tool_env import load_tool


def _tool():
    return load_tool("sass_stats")


PTXAS = """\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function '_Z3fwdv' for 'sm_90a'
ptxas info    : Function properties for _Z3fwdv
    16 bytes stack frame, 12 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 168 registers, used 1 barriers
ptxas info    : Compiling entry function '_Z3bwdv' for 'sm_90a'
ptxas info    : Function properties for _Z3bwdv
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 240 registers, used 16 barriers
"""

SASS = """\
\tcode for sm_90a
\t\tFunction : _Z3fwdv
\t.headerflags\t@"EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
        /*0000*/                   LDC R1, c[0x0][0x28] ;                  /* 0x00000a00ff017b82 */
        /*0010*/                   IMAD.WIDE.U32 R4, R0, -0x2daee0ad, RZ ; /* 0x000000 */
        /*0020*/               @P0 LOP3.LUT R4, R4, 0xff, RZ, 0xc0, !PT ;  /* 0x000000 */
        /*0030*/              @!P1 EXIT ;                                  /* 0x000000 */
        /*0040*/                   BRA 0x40;                               /* 0x000000 */
\t\t..........

\t\tFunction : _Z3bwdv
        /*0000*/                   LOP3.LUT R2, R2, 0x7f7f7f7f, RZ, 0xc0, !PT ;
        /*0010*/                   EXIT ;
"""


def test_parses_registers_spills_and_opcodes():
    tool = _tool()
    stats = tool.parse_ptxas(PTXAS)
    assert stats == {"_Z3fwdv": {"regs": 168, "spill": 12}, "_Z3bwdv": {"regs": 240, "spill": 0}}
    sass = tool.parse_sass(SASS)
    assert sass == {"_Z3fwdv": ["LDC", "IMAD", "LOP3", "EXIT", "BRA"], "_Z3bwdv": ["LOP3", "EXIT"]}


def test_report_sets_each_kernel_beside_its_base():
    tool = _tool()
    after = (tool.parse_ptxas(PTXAS), tool.parse_sass(SASS))
    base_sass = SASS.replace("        /*0020*/               @P0 LOP3.LUT R4, R4, 0xff, RZ, 0xc0, !PT ;  /* 0x000000 */\n", "")
    base_sass = base_sass.replace("LDC R1", "PRMT R1")
    before = (tool.parse_ptxas(PTXAS.replace("Used 168", "Used 160")), tool.parse_sass(base_sass))
    lines = tool.report(after, before, ops=True)
    fwd = next(line for line in lines if "fwd" in line)
    assert "regs 168" in fwd and "base regs 160" in fwd and "instr      5" in fwd and "(+1)" in fwd
    assert "LDC +1" in fwd and "LOP3 +1" in fwd and "PRMT -1" in fwd
    bwd = next(line for line in lines if "bwd" in line)
    assert "(+0)" in bwd and "\n" not in bwd  # no opcode differs: no second line
