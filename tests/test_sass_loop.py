"""profiles/sass_loop.py: the steady-state loop found in SASS text and its summary (CPU), and on a real cubin of our
CuTe forward compiled for sm_90a here (one subprocess; flash-attn-4's side needs its package, not in CI)."""
import json

import pytest
from conftest import compiled_script_output

from kernels.cute_runtime import dsl_available
from profiles import sass_loop as S

# a peeled QK^T, then a loop (.L_x_1 .. its back branch) with both GEMMs and the exps, and an outer loop around it
SASS = """
        /*0000*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT, gsb0 ;
.L_x_0:
        /*0010*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR15+0x10], R5 ;
.L_x_1:
        /*0020*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR15+0x10], R5 ;
        /*0030*/                   BAR.SYNC.DEFER_BLOCKING R5, 0x100 ;
        /*0040*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR16], RZ, !UPT ;
        /*0050*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR20], R24, gsb0 ;
        /*0060*/                   HGMMA.64x128x16.F32.BF16 R88, R152, gdesc[UR16].tnspB, R88, gsb0 ;
        /*0070*/              @!P0 BAR.ARV 0x4, 0x100 ;
        /*0080*/                   WARPGROUP.DEPBAR.LE gsb0, 0x1 ;
        /*0090*/                   SHFL.BFLY PT, R5, R14, 0x2, 0x1f ;
        /*00a0*/                   MUFU.EX2 R24, R24 ;
        /*00b0*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
        /*00c0*/                   MUFU.EX2 R25, R25 ;
        /*00d0*/                   FADD R7, R24, R25 ;
        /*00e0*/                   UIADD3 UR4, UR4, 0x1, URZ ;
        /*00f0*/               @P0 BRA `(.L_x_1) ;
        /*0100*/               @P1 BRA `(.L_x_0) ;
        /*0110*/                   EXIT ;
"""


def test_the_inner_loop_and_its_events():
    instrs, labels = S.parse_sass(SASS)
    assert labels == {".L_x_0": 1, ".L_x_1": 2} and instrs[0].startswith("HGMMA") and len(instrs) == 18
    body = S.steady_loop(instrs, labels)
    assert body[0].startswith("SYNCS") and body[-1] == "@P0 BRA `(.L_x_1)"  # the inner loop, not the outer one
    row = S.loop_summary(body)
    assert (row["instructions"], row["HGMMA"], row["MUFU"], row["FADD"], row["BRA"], row["uniform"]) == (
        14, 3, 2, 1, 1, 1)
    assert row["exps_before_pv_wait"] == 1
    assert row["events"] == "0:wait 1:bar 2:qk x2 4:pv 5:arv 6:depbar<=1 7:shfl 9:depbar<=0"


def test_no_loop_with_both_gemms_is_an_error():
    instrs, labels = S.parse_sass(SASS.replace("tnspB", ""))
    with pytest.raises(ValueError, match="no loop holds both GEMMs"):
        S.steady_loop(instrs, labels)


@pytest.mark.skipif(not dsl_available(), reason="nvidia-cutlass-dsl is not installed")
def test_our_kernel_compiled_here_has_the_loop():
    # d128 non-causal (case 0): the loop issues QK^T (8 k-steps of 16) and PV (8), and the exps of 2 rows x 32 cols
    out = compiled_script_output("import json, profiles.sass_loop as S; "
                                 "print(json.dumps(S.main(['--cases', '0', '--no-peer'])))")
    (row,) = json.loads(out.splitlines()[-1])
    assert row["code"] == "ours" and row["HGMMA"] == 16 and row["MUFU"] >= 64, row
    assert "qk x8" in row["events"] and "pv x8" in row["events"], row


def test_config_overrides():
    assert S.parse_overrides(["hoisted_qk_desc=True", "tile_n=176"]) == {"hoisted_qk_desc": True, "tile_n": 176}
    with pytest.raises(SystemExit, match="FIELD=VALUE"):
        S.parse_overrides(["hoisted_qk_desc"])
