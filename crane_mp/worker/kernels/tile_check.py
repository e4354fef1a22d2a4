"""Whether GGUF prompts take the AMX-INT8 tiles (gguf_tiles.cpp): on the amx tier, where the tile kernels
run right on this host. A child process is asked: it multiplies Q4_K, Q6_K, Q4_0 and Q8_0 prompts through
them and through the AVX512-VNNI kernels and exits 0 only when every output is the same bit for bit. A
fault (a hypervisor that withholds the tile state, as llama.cpp's AMX path meets on some hosts, or a tile
configuration the CPU refuses) kills the child, not the worker. The verdict is kept beside the kernels'
build, per CPU model, so that later starts skip the check."""

from __future__ import annotations

import hashlib
import logging
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import torch

from crane_mp.worker.kernels.cpu_isa import kernel_isa

log = logging.getLogger(__name__)

PASSED = "passed"


@lru_cache(maxsize=1)
def int8_tiles() -> bool:
    """Turns GGUF prompts onto the AMX-INT8 tiles where they are built, the OS granted the tile state and
    the child's check passed; says why not where it failed."""
    if kernel_isa() != "amx" or not torch.ops.crane_mp.gguf_tiles_available():
        return False
    passed, why = run_check()
    if not passed:
        log.warning("AMX-INT8 tiles failed their check on this host (%s); GGUF prompts keep the AVX512-VNNI "
                    "kernels", why)
        return False
    torch.ops.crane_mp.gguf_tile_kernels(1)
    log.info("GGUF prompts run on the AMX-INT8 tiles")
    return True


def _cpu_key() -> str:
    """The CPU's model, microcode and flags, hashed: a cache directory several hosts share keeps a verdict each."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    wanted = [line for line in lines if line.startswith(("model name", "microcode", "flags"))][:3]
    return hashlib.sha256("\n".join(wanted).encode()).hexdigest()[:12]


def _verdict_file() -> Path | None:
    from crane_mp.worker.kernels.loader import build_name, compiler_identity, kernel_cache_dir

    compiler, cache = compiler_identity(), kernel_cache_dir()
    if compiler is None or cache is None:
        return None
    return cache / f"{build_name('amx', *compiler)}.tiles-{_cpu_key()}"


def run_check() -> tuple[bool, str]:
    """(the tiles passed, what happened), from the kept verdict or a fresh child."""
    verdict_file = _verdict_file()
    if verdict_file is not None and verdict_file.exists():
        verdict = verdict_file.read_text()
        return verdict == PASSED, verdict
    try:
        child = subprocess.run([sys.executable, "-m", __name__], capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        return False, "no answer in 600 s"  # not kept: a busy host may answer the next start
    except OSError as err:  # no child allowed here (a sandbox): not kept either
        return False, f"no child process: {err}"
    tail = (child.stderr or child.stdout).strip().splitlines()[-1:] or [""]
    verdict = PASSED if child.returncode == 0 else f"exited {child.returncode}: {tail[0][-300:]}"
    if verdict_file is not None:
        verdict_file.write_text(verdict)
    return verdict == PASSED, verdict


def _weights(qtype: int, rows: int, cols: int, generator: torch.Generator) -> torch.Tensor:
    """Random GGUF rows of `qtype` with finite float16 scales, repacked sixteen rows a group."""
    from gguf import GGMLQuantizationType as T

    block, block_bytes, scale_at = {T.Q4_K: (256, 144, (0, 2)), T.Q6_K: (256, 210, (208,)), T.Q8_0: (32, 34, (0,)),
                                    T.Q4_0: (32, 18, (0,))}[qtype]
    blocks = cols // block
    weight = torch.randint(0, 256, (rows, blocks, block_bytes), dtype=torch.uint8, generator=generator)
    for offset in scale_at:
        scales = torch.rand(rows, blocks, generator=generator) * 0.01 + 0.001
        weight[:, :, offset:offset + 2] = scales.half().view(torch.uint8).reshape(rows, blocks, 2)
    op = {T.Q4_K: "gguf_repack_q4_k_x16", T.Q6_K: "gguf_repack_q6_k_x16", T.Q8_0: "gguf_repack_q8_0_x8",
          T.Q4_0: "gguf_repack_q4_0_x16"}[qtype]
    return getattr(torch.ops.crane_mp, op)(weight.reshape(rows, -1), cols)


def compare(mode: int) -> str | None:
    """Prompts of 16 to 130 rows through the tile kernels of `mode` (gguf_tiles.cpp: 1 AMX, 2 software)
    and without them; None when every output is the same bit for bit, else what differed."""
    from gguf import GGMLQuantizationType as T

    from crane_mp.worker.quantized.formats import Q4_0_X16, Q4_K_X16, Q6_K_X16, Q8_0_X8

    generator = torch.Generator().manual_seed(0)
    for qtype, packed_type in ((T.Q4_K, Q4_K_X16), (T.Q6_K, Q6_K_X16), (T.Q4_0, Q4_0_X16), (T.Q8_0, Q8_0_X8)):
        if qtype == T.Q6_K and not torch.ops.crane_mp.gguf_x16_supported(qtype):
            continue
        weight = _weights(qtype, 48, 768, generator)
        for rows in (16, 37, 130):
            x = torch.randn(rows, 768, generator=generator) * 3
            previous = torch.ops.crane_mp.gguf_tile_kernels(0)
            try:
                want = torch.ops.crane_mp.gguf_linear_int8(x, weight, packed_type, 768)
                torch.ops.crane_mp.gguf_tile_kernels(mode)
                got = torch.ops.crane_mp.gguf_linear_int8(x, weight, packed_type, 768)
            finally:
                torch.ops.crane_mp.gguf_tile_kernels(previous)
            if not torch.equal(got, want):
                return (f"{T(qtype).name}, {rows} rows: the tiles differ from the VNNI kernels by up to "
                        f"{(got - want).abs().max().item():.3g}")
    return None


def main() -> int:
    if kernel_isa() != "amx" or not torch.ops.crane_mp.gguf_tiles_available():
        print(f"the amx kernels did not load here (tier {kernel_isa()})", file=sys.stderr)
        return 2
    difference = compare(1)
    if difference is not None:
        print(difference, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
