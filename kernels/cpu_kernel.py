"""The compiled CPU kernels (``kernels/csrc/``: decode and prefill attention, quantized linear layers, fused
elementwise ops, a decode step's whole layer stack): built once per machine with torch's C++ extension
tooling into the Tandem cache, loaded once per process.

    if cpu_kernel.available():
        out = cpu_kernel.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale=scale)

It needs a C++ compiler and a CPU with AVX2 and FMA (ATen's AVX2 vector types); where either is
missing, or the build fails, ``available()`` is False (with the reason in ``unavailable_reason()``),
attention stays on the torch path and weights stay dense. ``TANDEM_CPU_KERNEL=0`` turns it off (A/B
benchmarks). ``TANDEM_CPU_ISA`` (avx2, avx_vnni, avx512_vnni, amx; default the CPU's best) pins the instruction set
a process's kernels start on, before any weights are laid out for it: an older CPU's path measured on a newer one,
or a set an operator wants to avoid. A name the kernels do not know, or a set this CPU lacks, stops the load with
that name.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import Tensor

from kernels import kv_quant
from kernels.cache_dir import cache_root

log = logging.getLogger(__name__)

SOURCES = [Path(__file__).resolve().parent / "csrc" / name for name in (
    "paged_decode_cpu.cpp", "paged_prefill_cpu.cpp", "quant_linear_cpu.cpp", "quant_linear_x8_cpu.cpp",
    "fused_ops_cpu.cpp", "decoder_cpu.cpp", "cpu_isa.cpp", "thread_team.cpp", "sampling_cpu.cpp")]
HEADERS = sorted((Path(__file__).resolve().parent / "csrc").glob("*.h"))
HEAD_DIMS = (16, 32, 64, 128, 256)
MAX_HEADS_PER_KV = 16
CACHE_DTYPES = (torch.float32, torch.float16, torch.int8)  # what decode attention reads (fp32 queries either way)
_NAME = "tandem_cpu_kernels"
# -ffp-contract=off: a dequantized weight is d * q + m rounded twice, as the gguf package computes it.
_FLAGS = ["-O3", "-ffp-contract=off", "-fopenmp", "-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2",
          "-DCPU_CAPABILITY_AVX2"]


def available() -> bool:
    return _load() is None


def unavailable_reason() -> str | None:
    return _load()


def instruction_set_in_use() -> str | None:
    """The instruction set the kernels run now ("avx2" .. "amx"), or None where they did not load."""
    return torch.ops.tandem_cpu.isa() if available() else None


def supports(q: Tensor, k_cache: Tensor) -> bool:
    """The shapes and dtypes the kernel takes (anything else stays on the torch path)."""
    return (q.dtype == torch.float32 and k_cache.dtype in CACHE_DTYPES and q.shape[-1] in HEAD_DIMS
            and kv_quant.head_dim_of(k_cache) == q.shape[-1]
            and q.shape[1] % k_cache.shape[2] == 0 and q.shape[1] // k_cache.shape[2] <= MAX_HEADS_PER_KV)


def _query_rows(q: Tensor) -> Tensor:
    """q as the kernels read it: its token rows may lie apart (a view of QKV's rows: no copy), each row's heads
    packed."""
    return q if q.stride(2) == 1 and q.stride(1) == q.shape[2] else q.contiguous()


def paged_decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, seq_lens: Tensor, *,
                           scale: float) -> Tensor:
    """Shapes as ``torch_decode.paged_decode_attention_torch``; fp32 on CPU."""
    return torch.ops.tandem_cpu.paged_decode_attention(_query_rows(q), k_cache, v_cache, block_tables.contiguous(),
                                                       seq_lens.contiguous(), scale)


def paged_prefill_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                            query_start_loc: Tensor, seq_lens: Tensor, *, scale: float) -> Tensor:
    """Shapes as ``torch_paged.paged_prefill_attention_torch``; fp32 queries on CPU, causal after each
    sequence's cached tokens (``kernels/csrc/paged_prefill_cpu.cpp``)."""
    return torch.ops.tandem_cpu.paged_prefill_attention(
        _query_rows(q), k_cache, v_cache, block_tables.to(torch.int32).contiguous(),
        query_start_loc.to(torch.int32).contiguous(), seq_lens.to(torch.int32).contiguous(), scale)


def store_kv(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    """Shapes as ``torch_paged.store_kv_torch``; rows of the caches' dtype, or fp32 rows into fp16 or int8 caches."""
    torch.ops.tandem_cpu.store_kv(k, v, k_cache, v_cache, slot_mapping)


INSTRUCTION_SETS = ("avx2", "avx_vnni", "avx512_vnni", "amx")  # oldest first, as the kernels name them


def pinned_instruction_set() -> str | None:
    """TANDEM_CPU_ISA's set, or None where it is unset; ValueError naming it where the kernels know no such set
    (whether this CPU has it is for the process that loads them to say)."""
    pinned = os.environ.get("TANDEM_CPU_ISA") or None
    if pinned is not None and pinned not in ("best", *INSTRUCTION_SETS):
        known = ", ".join(("best", *INSTRUCTION_SETS))
        raise ValueError(f"TANDEM_CPU_ISA={pinned}: unknown instruction set; known: {known}")
    return pinned


def instruction_sets() -> list[str]:
    """The instruction sets the compiled kernels run on this CPU, oldest first ("avx2", then "avx_vnni",
    "avx512_vnni" and "amx" where it has them: "amx" is "avx512_vnni" with the quantized matrices on AMX-INT8 tiles
    from ``amx_min_rows()`` rows of x); ``torch.ops.tandem_cpu.set_isa(name)`` picks one for the quantized
    matrices and decode attention (A/B benches, tests), "best" the last; none where the kernels did not build."""
    if not available():
        return []
    now = torch.ops.tandem_cpu.isa()
    have = []
    for isa in INSTRUCTION_SETS:
        try:
            have.append(torch.ops.tandem_cpu.set_isa(isa))
        except RuntimeError:  # the CPU lacks it
            pass
    torch.ops.tandem_cpu.set_isa(now)
    return have


def pairs_groups() -> bool:
    """Whether ``quant_linear.interleave`` stores 8-row groups two by two ("x8p"): where the instruction set in
    use is "avx512_vnni" or "amx" and its 512-bit loop runs from one row of x (``min_rows_for_pairs``: not on Zen 4)."""
    return (available() and torch.ops.tandem_cpu.isa() in ("avx512_vnni", "amx")
            and torch.ops.tandem_cpu.min_rows_for_pairs() == 1)


@contextlib.contextmanager
def instruction_set(name: str) -> Iterator[str]:
    """The kernels run on ``name`` inside the block (A/B benches, tests), on what they ran before after it."""
    before = torch.ops.tandem_cpu.isa()
    try:
        yield torch.ops.tandem_cpu.set_isa(name)
    finally:
        torch.ops.tandem_cpu.set_isa(before)


@functools.cache  # one build-or-load per process; None when loaded, else why not
def _load() -> str | None:
    if os.environ.get("TANDEM_CPU_KERNEL", "1") == "0":
        return "turned off by TANDEM_CPU_KERNEL=0"
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return f"the CPU lacks AVX2 (torch reports {torch.backends.cpu.get_cpu_capability()})"
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        return "no C++ compiler (c++) on PATH"
    from torch.utils import cpp_extension

    build_dir = cache_root() / "kernels" / f"{_NAME}-torch{torch.__version__}"
    build_dir.mkdir(parents=True, exist_ok=True)
    try:
        with _exclusive(build_dir), _ninja_on_path():
            if not (build_dir / f"{_NAME}.so").exists():
                log.warning("building the CPU decode-attention kernel into %s (once per machine, ~10-30 s)", build_dir)
            cpp_extension.load(name=_NAME, sources=[str(p) for p in SOURCES],
                               extra_cflags=[*_FLAGS, _headers_digest()], build_directory=str(build_dir),
                               is_python_module=False, verbose=False)
    except Exception as e:  # noqa: BLE001 - any build failure leaves the torch path, said once
        reason = f"the build failed: {str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__}"
        log.warning("CPU decode-attention kernel unavailable (%s); using the torch path", reason)
        return reason
    pinned = pinned_instruction_set()
    if pinned:
        try:
            torch.ops.tandem_cpu.set_isa(pinned)
        except RuntimeError as e:  # a set this CPU (or its OS) lacks: a setting that cannot be honoured stops the load
            raise RuntimeError(f"TANDEM_CPU_ISA={pinned}: {str(e).strip().splitlines()[0]}") from None
    return None


def _headers_digest() -> str:
    """A define that changes with the headers: torch rebuilds when sources or flags change, and reads no
    header, so an edited header alone would leave the old build in place."""
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in HEADERS)).hexdigest()[:16]
    return f"-DTANDEM_HEADERS_DIGEST={digest}"


@contextlib.contextmanager
def _exclusive(build_dir: Path) -> Iterator[None]:
    """One builder per machine. torch's own lock file outlives a builder that was killed and would make
    every later load wait forever; under this lock (released by the OS when its holder dies) a leftover
    one is stale and is removed."""
    with open(build_dir / ".tandem-build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        (build_dir / "lock").unlink(missing_ok=True)
        yield


@contextlib.contextmanager
def _ninja_on_path() -> Iterator[None]:
    """torch's builder runs ``ninja`` from PATH; the PyPI package's binary sits in the venv, which a
    process started as ``.venv/bin/python`` does not have on PATH."""
    try:
        import ninja
    except ImportError:
        yield
        return
    old = os.environ.get("PATH", "")
    os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{old}"
    try:
        yield
    finally:
        os.environ["PATH"] = old
