"""Triton kernels compiled for an H100 (sm_90) ahead of time, on any machine: no GPU is
needed to compile, only to run. What the cubin says of a launch's footprint on an SM
(registers and local memory a thread) is read from its `.nv.info` attributes, the
numbers the driver would report once it is loaded."""

from __future__ import annotations

import struct
from dataclasses import dataclass

import triton
from triton.backends.compiler import GPUTarget

HOPPER = GPUTarget("cuda", 90, 32)
SM90_REGISTERS = 65536  # a Hopper SM's register file, 32-bit registers
SM90_SHARED = 228 * 1024  # its shared memory; each resident program also holds 1 KB
SM90_SHARED_PER_PROGRAM = 227 * 1024  # the most one program may take of it


def compile_for_hopper(
    fn,
    signature: dict[str, str],
    constexprs: dict[str, object],
    aligned: set[str] | None = None,
    options: dict[str, int] | None = None,
) -> triton.compiler.CompiledKernel:
    """`aligned`: the int arguments a launch passes as multiples of 16 (strides, widths).
    Given, they and every pointer get the divisibility hint Triton's launcher adds for
    such values, so the loads vectorize as they do on the GPU. `options`: num_warps,
    num_stages."""
    for name in constexprs:
        signature[name] = "constexpr"
    attrs = None
    if aligned is not None:
        hinted = [n for n, kind in signature.items() if kind.startswith("*") or n in aligned]
        attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in hinted}
    source = triton.compiler.ASTSource(
        fn=fn, signature=signature, constexprs=constexprs, attrs=attrs
    )
    return triton.compile(source, target=HOPPER, options=options or {})


def by_name(kernel, constexprs: dict, pointers: dict, floats: set[str] = frozenset()) -> dict:
    """A signature for every argument of kernel not in constexprs: pointers (by name,
    else bf16), fp32 scalars, else i32."""
    signature = {}
    for name in kernel.arg_names:
        if name in constexprs:
            continue
        if name.endswith("_ptr"):
            signature[name] = pointers.get(name, "*bf16")
        else:
            signature[name] = "fp32" if name in floats else "i32"
    return signature


@dataclass(frozen=True)
class Footprint:
    """One program's claim on an SM."""

    registers: int  # a thread's
    local_bytes: int  # a thread's stack frame: registers spilled to local memory
    shared_bytes: int
    num_warps: int

    def programs_per_sm(self) -> int:
        """How many programs of this kernel an SM holds at once: registers are allocated
        per warp in blocks of 256, shared memory per program with 1 KB reserved; at most
        64 warps and 32 programs."""
        per_warp = -(-self.registers * 32 // 256) * 256
        by_registers = SM90_REGISTERS // per_warp // self.num_warps
        by_shared = SM90_SHARED // (self.shared_bytes + 1024)
        return min(by_registers, by_shared, 64 // self.num_warps, 32)


# .nv.info attributes (EIATTR_*): a 4-byte header (format, attribute, payload size) and,
# for sized entries, the payload: the kernel's symbol index, then the value.
_SIZED, _FRAME_SIZE, _REGCOUNT = 0x04, 0x11, 0x2F


def footprint(kernel: triton.compiler.CompiledKernel) -> Footprint:
    """Registers and local memory a thread from the cubin's `.nv.info` section."""
    cubin = kernel.asm["cubin"]
    (section_table,) = struct.unpack_from("<Q", cubin, 0x28)
    entry_size, count, names_index = struct.unpack_from("<HHH", cubin, 0x3A)
    sections = [
        struct.unpack_from("<IIQQQQIIQQ", cubin, section_table + i * entry_size)
        for i in range(count)
    ]
    names_offset = sections[names_index][4]
    values = {}
    for section in sections:  # ELF64 Shdr: name, type, flags, addr, offset, size, ...
        start, offset, size = names_offset + section[0], section[4], section[5]
        if cubin[start : cubin.index(b"\0", start)] != b".nv.info":
            continue
        info = cubin[offset : offset + size]
        at = 0
        while at + 4 <= len(info) and info[at] == _SIZED:
            attribute, payload = info[at + 1], struct.unpack_from("<H", info, at + 2)[0]
            if attribute in (_FRAME_SIZE, _REGCOUNT) and payload == 8:
                values[attribute] = struct.unpack_from("<I", info, at + 8)[0]
            at += 4 + payload
    if _REGCOUNT not in values:
        raise ValueError("no register count in the cubin's .nv.info")
    return Footprint(
        registers=values[_REGCOUNT],
        local_bytes=values.get(_FRAME_SIZE, 0),
        shared_bytes=kernel.metadata.shared,
        num_warps=kernel.metadata.num_warps,
    )
