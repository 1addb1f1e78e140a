"""scripts/kernel_asm.py's pure parts (the compile needs Python 3.12 + jax's CUDA plugin): the snappy
decoder that finds the cubin in a serialized executable, and the SASS loop counter."""

import importlib.util
from pathlib import Path

import pytest


def load():
    spec = importlib.util.spec_from_file_location("kernel_asm", Path(__file__).parents[1] / "scripts/kernel_asm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_unsnappy_literals_and_copies():
    asm = load()
    # "abcd" literal, then a 1-byte-offset copy of 8 bytes at offset 4 ("abcdabcd"), then "xyz"
    stream = bytes([15]) + bytes([3 << 2]) + b"abcd" + bytes([1 | ((8 - 4) << 2), 4]) + bytes([2 << 2]) + b"xyz"
    out, end = asm.unsnappy(stream)
    assert out == b"abcdabcdabcdxyz" and end == len(stream)
    with pytest.raises(ValueError):
        asm.unsnappy(bytes([8, 1 | (4 << 2), 9]))  # a copy before any output
    with pytest.raises((ValueError, IndexError)):
        asm.unsnappy(bytes([10, 9 << 2]) + b"ab")  # a literal past the end


def test_find_cubin_in_nested_streams():
    asm = load()
    elf = bytearray(b"\x7fELF" + bytes(60))
    elf[0x28:0x30] = (64).to_bytes(8, "little")  # one 64-byte section header right after the header
    elf[0x3A:0x3C], elf[0x3C:0x3E] = (64).to_bytes(2, "little"), (1).to_bytes(2, "little")
    elf = bytes(elf) + b".text.jpaged_decode".ljust(64, b"\x00")  # 128 bytes, the name inside
    payload = b"xla.gpu.GpuExecutableProto" + bytes(5000) + elf + b"trailing bytes"

    def literal(data):  # one snappy stream of one literal
        n = len(data)
        head, length = bytearray(), n
        while True:
            head.append((length & 0x7F) | (0x80 if length > 0x7F else 0))
            length >>= 7
            if not length:
                break
        return bytes(head) + bytes([62 << 2]) + (n - 1).to_bytes(3, "little") + data

    blob = b"pickle..." + literal(b"xla.outer" + bytes(4100) + literal(payload))
    assert asm.find_cubin(blob, "jpaged_decode") == elf
    with pytest.raises(RuntimeError, match="jpaged_prefill"):
        asm.find_cubin(blob, "jpaged_prefill")


SASS = """
        /*0100*/                   DEPBAR.LE SB0, 0x2 ;
        /*0110*/                   LDGSTS.E.BYPASS.128 [R0], desc[UR8][R4.64] ;
        /*0120*/                   F2FP.F16.E4M3.UNPACK_B R2, R3 ;
        /*0130*/                   F2F.BF16.F16 R5, R2 ;
        /*0140*/                   HMMA.16816.F32 R8, R4, R6, R8 ;
        /*0150*/                   IMAD.MOV.U32 R1, RZ, RZ, R2 ;
        /*0160*/                   LOP3.LUT R1, R1, 0x3, RZ, 0xc0, !PT ;
        /*0170*/               @P0 BRA 0x100 ;
        /*0180*/                   EXIT ;
"""


def test_sass_loops_and_classes():
    asm = load()
    loops = asm.sass_loops(SASS)
    assert len(loops) == 1 and len(loops[0]) == 8
    rows = dict(asm.classify(loops[0]))
    assert rows["global -> shared copies (LDGSTS)"] == 1
    assert rows["fp8 -> f16 pairs (F2FP.*.UNPACK)"] == 1 and rows["f16 -> bf16 (F2F.BF16.F16), one value each"] == 1
    assert rows["tensor core (HMMA, HGMMA, QGMMA)"] == 1 and rows["moves (MOV, IMAD.MOV)"] == 1
    assert rows["barriers and waits (BAR, DEPBAR)"] == 1
    other = [name for name in rows if name.startswith("other")]
    assert other == ["other: LOP3.LUT 1, BRA 1"] and sum(rows.values()) == 8
