"""Device facts the launch heuristics need, read once per device (no host sync: properties only).

The one place where a GPU's architecture picks the code paths (DESIGN.md: runs wherever Triton
runs). `arch_of(device)` describes the device as an `Arch`; every op and writer (quant's Triton
writers included: this module imports nothing from openmla) asks it instead of probing the GPU:
  - `gluon_sm90`: the Hopper Gluon kernels (wgmma, sm_90 only) or the portable Triton kernels;
  - `e4m3`: how e4m3 bytes become numbers (quant/e4m3.py): the sm_89+ `cvt` instruction, Triton's
    float8e4nv type, or integer arithmetic where Triton has no float8e4nv (NVIDIA before sm_89);
  - `ptx`: inline PTX may run (NVIDIA, compiled; never AMD or the interpreter);
  - `smem_bytes`: the shared memory (LDS) one program may use, for the configs' prune rules.
`ARCHES` names the targets the ahead-of-time compile test builds for (tests/kernels/
test_aot_compile.py), and `assume(arch)` makes every device look like one of them, so that the
dispatch picks, for CPU tensors, the kernels and configs it would pick on that GPU.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import importlib.util
import os
from typing import Union

import torch
import triton

_SM_COUNT: dict = {}


def num_sms(device) -> int:
    """Multiprocessor count of a device (torch.device or str; cached). Elsewhere than CUDA (the CPU
    interpreter) it pretends to have 8, so that the split paths (split-K, split-KV) and the
    decisions made from it are exercised by the CPU tests with small shapes."""
    device = torch.device(device)
    if device.type != "cuda":
        return 8
    key = device.index if device.index is not None else torch.cuda.current_device()
    if key not in _SM_COUNT:
        _SM_COUNT[key] = torch.cuda.get_device_properties(key).multi_processor_count
    return _SM_COUNT[key]


_HAS_GLUON = importlib.util.find_spec("triton.experimental.gluon") is not None

# How e4m3fn bytes are converted (quant/e4m3.py): Triton's float8e4nv type, the sm_89+ PTX
# instruction cvt.rn.f16x2.e4m3x2 (two bytes an instruction), or integer arithmetic.
E4M3_CAST, E4M3_PTX, E4M3_BITS = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class Arch:
    """A GPU architecture as the dispatch sees it.

    backend: "cuda", "hip", or "interpreter" (Triton's CPU interpreter).
    arch: compute capability as major * 10 + minor for CUDA (90 = sm_90), the gfx name for HIP.
    warp_size: threads per warp (wavefront).
    smem_bytes: shared memory (LDS) one program may allocate: the opt-in per-block limit.
    """
    backend: str
    arch: Union[int, str]
    warp_size: int
    smem_bytes: int

    @property
    def name(self) -> str:
        return f"sm_{self.arch}" if self.backend == "cuda" else str(self.arch)

    @property
    def gluon_sm90(self) -> bool:
        """The Hopper Gluon kernels may run: sm_90 (wgmma, 227 KB shared memory), a Triton with
        Gluon, and not switched off with OPENMLA_SM90_GLUON=0."""
        return (self.backend == "cuda" and self.arch // 10 == 9 and _HAS_GLUON
                and os.environ.get("OPENMLA_SM90_GLUON", "1") != "0")

    @property
    def mma(self) -> str:
        """The tensor-core instructions Triton 3.6 gives a dot of 64 rows or more, which decide
        how many operand buffers it keeps in shared memory: "wgmma" (sm_90; the interpreter
        plans as sm_90 does), "tcgen05" (sm_100 family), "mma" (mma.sync: sm_80 to sm_89,
        sm_120), "mfma" (AMD)."""
        if self.backend == "hip":
            return "mfma"
        if self.backend == "interpreter" or self.arch // 10 == 9:
            return "wgmma"
        return "tcgen05" if self.arch // 10 == 10 else "mma"

    @property
    def maxnreg(self) -> bool:
        """Launches may cap registers per thread (an NVIDIA ptxas option; AMD's backend rejects
        it, the interpreter ignores it)."""
        return self.backend != "hip"

    @property
    def ptx(self) -> bool:
        """Inline PTX may run (NVIDIA, compiled)."""
        return self.backend == "cuda"

    @property
    def e4m3(self) -> int:
        """E4M3_PTX on NVIDIA sm_89+, E4M3_BITS on older NVIDIA GPUs (Triton 3.6 has no
        float8e4nv type before sm_89, not even for loads), E4M3_CAST elsewhere (AMD, interpreter)."""
        if self.backend != "cuda":
            return E4M3_CAST
        return E4M3_PTX if self.arch >= 89 else E4M3_BITS

    @property
    def fp8_type(self) -> bool:
        """Tensors of torch.float8_e4m3fn may be passed to a kernel as such (else as uint8)."""
        return self.e4m3 != E4M3_BITS

    @property
    def e4m3_plain(self) -> int:
        """The e4m3 path of code whose result feeds no dot (cache writers and gathers): Triton's
        own conversion where it has the type, E4M3_BITS where it has not."""
        return E4M3_CAST if self.fp8_type else E4M3_BITS

    def target(self):
        """Triton's GPUTarget for ahead-of-time compiles (CUDA 90 compiles as sm_90a)."""
        from triton.backends.compiler import GPUTarget
        return GPUTarget(self.backend, self.arch, self.warp_size)


# Per-block opt-in shared memory of the CUDA generations (CUDA programming guide, compute
# capabilities table) and LDS per workgroup of the AMD ones.
_SMEM_CUDA = {80: 166912, 86: 101376, 87: 166912, 89: 101376, 90: 232448, 100: 232448,
              103: 232448, 110: 232448, 120: 101376, 121: 101376}
_SMEM_HIP = {"gfx942": 65536, "gfx950": 163840}

# The targets of the ahead-of-time compile test: Ampere (A100, A10/RTX 30), Ada (L40, RTX 40),
# Hopper (H100/H200), Blackwell (B200, RTX 50), AMD CDNA3 (MI300) and CDNA4 (MI350).
ARCHES = {a.name: a for a in (
    *(Arch("cuda", cc, 32, _SMEM_CUDA[cc]) for cc in (80, 86, 89, 90, 100, 120)),
    *(Arch("hip", gfx, 64, smem) for gfx, smem in _SMEM_HIP.items()),
)}

# The interpreter runs what it is given; it plans as an sm_90 would (the configs the GPU tests
# time), so that the CPU tests exercise those shapes.
INTERPRETER = Arch("interpreter", 0, 32, _SMEM_CUDA[90])

_ASSUMED: contextvars.ContextVar = contextvars.ContextVar("openmla_assumed_arch", default=None)
_ARCH: dict = {}


@contextlib.contextmanager
def assume(arch: Arch):
    """Within this block every device is `arch` for the dispatch: ahead-of-time compiles (the
    launches are captured, not run), and tests of another GPU's path. A kernel launched for real
    compiles for the real device with `arch`'s choices, which run where that GPU's code runs
    (sm_80's on any later NVIDIA GPU) and nowhere else (sm_90's Gluon kernels on an A100)."""
    token = _ASSUMED.set(arch)
    try:
        yield arch
    finally:
        _ASSUMED.reset(token)


def arch_of(device) -> Arch:
    """The architecture of a device (torch.device or str; cached per GPU)."""
    assumed = _ASSUMED.get()
    if assumed is not None:
        return assumed
    device = torch.device(device)
    if device.type != "cuda" or triton.knobs.runtime.interpret:
        return INTERPRETER
    key = device.index if device.index is not None else torch.cuda.current_device()
    if key not in _ARCH:
        props = triton.runtime.driver.active.utils.get_device_properties(key)
        if torch.version.hip is not None:
            gfx = torch.cuda.get_device_properties(key).gcnArchName.split(":")[0]
            _ARCH[key] = Arch("hip", gfx, props.get("warpSize", 64), props["max_shared_mem"])
        else:
            major, minor = torch.cuda.get_device_capability(key)
            _ARCH[key] = Arch("cuda", major * 10 + minor, 32, props["max_shared_mem"])
    return _ARCH[key]


def sm90_gluon(device) -> bool:
    """Whether the Hopper Gluon kernels (kernels/*/sm90*.py) may run on `device`: a CUDA device of
    compute capability 9.x, a Triton with Gluon, not the interpreter (Gluon does not run there),
    and not switched off with OPENMLA_SM90_GLUON=0."""
    return arch_of(device).gluon_sm90
