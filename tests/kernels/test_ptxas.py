"""onnx_gtco.kernels.ptxas: parsing the ptxas -v report on canned text (no compiler needed)."""

from __future__ import annotations

from onnx_gtco.kernels.ptxas import KernelResources, parse_ptxas

SM80 = """\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function '_Z9gemm_tileP6__halfS0_Pfiii' for 'sm_80'
ptxas info    : Function properties for _Z9gemm_tileP6__halfS0_Pfiii
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 55 registers, used 1 barriers, 4608 bytes smem, 388 bytes cmem[0]
ptxas info    : Compile time = 29.434 ms
ptxas info    : Compiling entry function '_Z6reducePKfPf' for 'sm_80'
ptxas info    : Function properties for _Z6reducePKfPf
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 17 registers, used 0 barriers, 368 bytes cmem[0]
"""

SM90 = """\
ptxas info    : Compiling entry function 'wmma_gemm' for 'sm_90'
ptxas info    : Function properties for wmma_gemm
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 30 registers, used 0 barriers, 512 bytes smem
"""

SPILLING = """\
ptxas info    : Function properties for _Z6helperv
    8 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Compiling entry function 'big' for 'sm_80'
ptxas info    : Function properties for big
    48 bytes stack frame, 40 bytes spill stores, 36 bytes spill loads
ptxas info    : Used 255 registers, 360 bytes cmem[0]
"""


def test_sm80_form_with_cmem():
    gemm, reduce = parse_ptxas(SM80)
    assert gemm == KernelResources(name="_Z9gemm_tileP6__halfS0_Pfiii", arch="sm_80", registers=55, barriers=1,
                                   smem_bytes=4608, cmem_bytes=388, stack_frame_bytes=0, spill_store_bytes=0,
                                   spill_load_bytes=0)
    assert reduce.registers == 17 and reduce.smem_bytes == 0 and reduce.cmem_bytes == 368 and not reduce.spills


def test_sm90_form_without_cmem():
    (k,) = parse_ptxas(SM90)
    assert (k.arch, k.registers, k.barriers, k.smem_bytes, k.cmem_bytes) == ("sm_90", 30, 0, 512, None)


def test_multi_arch_report_gives_one_record_per_arch():
    kernels = parse_ptxas(SM80 + SM90.replace("wmma_gemm", "_Z6reducePKfPf"))
    assert [(k.name[:8], k.arch) for k in kernels] == [
        ("_Z9gemm_", "sm_80"), ("_Z6reduc", "sm_80"), ("_Z6reduc", "sm_90")]


def test_spills_and_device_function_frames():
    """A device function's frame is not charged to the next entry; the entry's own frame and spills are read."""
    (k,) = parse_ptxas(SPILLING)
    assert (k.stack_frame_bytes, k.spill_store_bytes, k.spill_load_bytes) == (48, 40, 36)
    assert k.spills and k.barriers is None and k.smem_bytes == 0 and k.cmem_bytes == 360


def test_no_report():
    assert parse_ptxas("") == []
    assert parse_ptxas("nvcc warning : something unrelated\n") == []
