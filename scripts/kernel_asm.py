"""The machine code of jpaged's attention kernels for a Hopper GPU, without a GPU: compile one kernel
for an H200 or H100 (deviceless, XLA's target description), then print its main loops' instructions
by class, its registers and shared memory (docs/PERF.md, "Hopper kernels from their PTX").

  Triton (Pallas): XLA keeps no PTX file for it, so the compiled executable is serialized, the
  sm_90a cubin found inside (two nested snappy streams), and disassembled with `cuobjdump -sass`
  (pip packages nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm, or a CUDA toolkit on PATH).
  Mosaic GPU: its kernels compile during the same compile; MOSAIC_GPU_DUMP_PTX writes their PTX
  and ptxas' report (registers), which this reads.

Needs Python 3.12 with jax[cuda13]==0.11.2 (the CUDA plugin; no GPU):

  JAX_PLATFORMS=cpu python scripts/kernel_asm.py --family pallas --pages e4m3
  JAX_PLATFORMS=cpu python scripts/kernel_asm.py --family pallas --pages bf16 --option num_stages=3
  JAX_PLATFORMS=cpu python scripts/kernel_asm.py --family mosaic --pages e4m3 --keep /tmp/asm
  JAX_PLATFORMS=cpu python scripts/kernel_asm.py --family pallas --pages e4m3 --option v_transposed=1
  JAX_PLATFORMS=cpu python scripts/kernel_asm.py --family mosaic --phase prefill --batch 1 --context 8192 \
      --option block_keys=128 --option mask_diagonal_only=1
"""

import argparse
import collections
import glob
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGETS = {"h200": "h200.txtpb", "h100": "h100_sxm.txtpb"}

# SASS opcode classes, first match wins (per thread per loop iteration).
SASS_CLASSES = [
    ("global -> shared copies (LDGSTS)", lambda o: o.startswith("LDGSTS")),
    ("global loads (LDG)", lambda o: o.startswith("LDG.") or o == "LDG"),
    ("shared loads (LDS, LDSM)", lambda o: o.startswith("LDS")),
    ("shared stores (STS, STSM)", lambda o: o.startswith("STS")),
    ("fp8 -> f16 pairs (F2FP.*.UNPACK)", lambda o: "UNPACK" in o),
    ("f16 -> bf16 (F2F.BF16.F16), one value each", lambda o: o.startswith("F2F.BF16")),
    ("other conversions (F2F, F2FP, I2F)", lambda o: o.startswith(("F2F", "I2F"))),
    ("byte permutes (PRMT)", lambda o: o == "PRMT"),
    ("selects (SEL)", lambda o: o.startswith("SEL")),
    ("tensor core (HMMA, HGMMA, QGMMA)", lambda o: o.startswith(("HMMA", "HGMMA", "QGMMA"))),
    ("fp32 math (FADD, FMUL, FFMA, FMNMX, FSEL, FSETP)",
     lambda o: o.startswith(("FADD", "FMUL", "FFMA", "FMNMX", "FSEL", "FSETP"))),
    ("exp2 (MUFU)", lambda o: o.startswith("MUFU")),
    ("shuffles (SHFL)", lambda o: o.startswith("SHFL")),
    ("moves (MOV, IMAD.MOV)", lambda o: o.startswith(("MOV", "IMAD.MOV"))),
    ("barriers and waits (BAR, DEPBAR)", lambda o: "BAR" in o),
]


def _varint(b, i):
    value = shift = 0
    while True:
        c = b[i]
        i += 1
        value |= (c & 0x7F) << shift
        shift += 7
        if not c & 0x80:
            return value, i


def unsnappy(b: bytes, i: int = 0) -> tuple[bytes, int]:
    """Decode one raw snappy stream starting at b[i]: (data, end). ValueError/IndexError if none."""
    n, i = _varint(b, i)
    if n > 1 << 30:
        raise ValueError("implausible length")
    out = bytearray()
    while len(out) < n:
        tag = b[i]
        i += 1
        kind = tag & 3
        if kind == 0:  # literal
            length = tag >> 2
            if length >= 60:
                extra = length - 59
                length = int.from_bytes(b[i:i + extra], "little")
                i += extra
            length += 1
            if i + length > len(b):
                raise ValueError("literal past the end")
            out += b[i:i + length]
            i += length
            continue
        if kind == 1:
            length, offset = ((tag >> 2) & 7) + 4, ((tag >> 5) << 8) | b[i]
            i += 1
        elif kind == 2:
            length, offset = (tag >> 2) + 1, int.from_bytes(b[i:i + 2], "little")
            i += 2
        else:
            length, offset = (tag >> 2) + 1, int.from_bytes(b[i:i + 4], "little")
            i += 4
        if not 0 < offset <= len(out):
            raise ValueError("bad copy offset")
        for _ in range(length):
            out.append(out[-offset])
    if len(out) != n:
        raise ValueError("length mismatch")
    return bytes(out), i


def _streams(b: bytes, depth: int = 0):
    """b, and every snappy stream nested in it that decodes to XLA protos (two levels deep)."""
    yield b
    if depth == 2:
        return
    for start in range(len(b) - 8):
        try:
            out, end = unsnappy(b, start)
        except (ValueError, IndexError):
            continue
        if len(out) > 4096 and end <= len(b) and b"xla." in out:
            yield from _streams(out, depth + 1)


def _elfs(b: bytes):
    pos = 0
    while (i := b.find(b"\x7fELF", pos)) >= 0:
        shoff = struct.unpack_from("<Q", b, i + 0x28)[0]
        shentsize, shnum = struct.unpack_from("<HH", b, i + 0x3A)
        phoff = struct.unpack_from("<Q", b, i + 0x20)[0]
        phentsize, phnum = struct.unpack_from("<HH", b, i + 0x36)
        yield b[i:i + max(shoff + shentsize * shnum, phoff + phentsize * phnum)]
        pos = i + 4


def find_cubin(serialized: bytes, kernel: str) -> bytes:
    """The cubin holding `kernel` (its .text section) inside a serialized jax executable."""
    for stream in _streams(serialized):
        for elf in _elfs(stream):
            if f".text.{kernel}".encode() in elf:
                return elf
    raise RuntimeError(f"no cubin with {kernel!r} in the executable")


def sass_loops(sass: str) -> list[list[str]]:
    """Each backward branch's body (a loop), as opcodes with their predicates stripped, in order."""
    code = [(int(m.group(1), 16), re.sub(r"^@!?U?P[T0-9]+\s+", "", m.group(2).strip()))
            for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", sass)]
    loops = []
    for addr, text in code:
        m = re.match(r"BRA\s+(?:`?\(?[.\w]*\)?\s*)?0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr and addr - int(m.group(1), 16) > 0x40:
            start = int(m.group(1), 16)
            loops.append([t for a, t in code if start <= a <= addr])
    return loops


def classify(ops: list[str]) -> list[tuple[str, int]]:
    """(class, count) rows for the opcodes of one loop, the unclassified ones last."""
    counts = collections.Counter(op.split()[0] for op in ops)
    by_class, rest = collections.Counter(), collections.Counter()
    for op, n in counts.items():
        name = next((name for name, test in SASS_CLASSES if test(op)), None)
        if name is None:
            rest[op] += n
        else:
            by_class[name] += n
    rows = [(name, by_class[name]) for name, _ in SASS_CLASSES if by_class[name]]
    if rest:
        rows.append(("other: " + ", ".join(f"{op} {n}" for op, n in rest.most_common(8)), sum(rest.values())))
    return rows


def _tool(name: str) -> str:
    found = shutil.which(name)
    if found:
        return found
    import site

    for base in site.getsitepackages():
        hits = glob.glob(os.path.join(base, "nvidia", "*", "bin", name))
        if hits:
            return hits[0]
    raise SystemExit(f"{name} not found: pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm (or a CUDA toolkit)")


def compile_kernel(args, dump_dir: str):
    """Compile the chosen kernel for the target without a GPU; returns the compiled executable."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import topologies
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    sys.path.insert(0, ROOT)
    import pallas_kernels as pk
    from pallas_kernels.decode import paged_attention_pallas
    from pallas_kernels.mosaic import paged_attention_mosaic, ragged_paged_attention_mosaic

    config = open(os.path.join(ROOT, "..", "shared", "gpu_targets", TARGETS[args.target])).read() \
        if args.target_config is None else open(args.target_config).read()
    topo = topologies.get_topology_desc("gpu", "cuda", target_config=config, topology="1x1x1")
    mesh = Mesh(topo.devices, ("x",))
    sharding = NamedSharding(mesh, PartitionSpec())

    def spec(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    dtype = jnp.dtype(args.dtype)
    pages_dtype = {"bf16": dtype, "e4m3": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2}[args.pages]
    page, d = args.page_size, args.head_dim
    num_pages = args.batch * args.context // page
    pages = spec((args.kv_heads, num_pages, page, d), pages_dtype)
    tables, lens = spec((args.batch, args.context // page), jnp.int32), spec((args.batch,), jnp.int32)
    options = {k: int(v) if v.isdigit() else v for k, v in (o.split("=", 1) for o in args.option)}
    if options.get("v_transposed"):  # V pages [kv heads, pages, head_dim, page] (cache_ops' variant layout)
        options["v_transposed"] = True
        v_pages = spec((args.kv_heads, num_pages, d, page), pages_dtype)
    else:
        v_pages = pages
    if args.phase == "decode":
        q = spec((args.batch, args.heads, d), dtype)
        if args.family == "pallas" and options:
            fn = lambda *a: paged_attention_pallas(*a, interpret=False, **options)  # noqa: E731
        elif options:
            fn = lambda *a: paged_attention_mosaic(*a, interpret=False, **options)  # noqa: E731
        else:
            fn = lambda *a: pk.paged_attention(*a, backend=args.family, interpret=False)  # noqa: E731
        inputs = (q, pages, v_pages, tables, lens)
    else:
        q = spec((args.batch * args.context, args.heads, d), dtype)
        if args.family == "mosaic" and options:
            from pallas_kernels.mosaic_wide import ragged_paged_attention_mosaic_wide as wide

            kernel = wide if options.pop("wide", 0) else ragged_paged_attention_mosaic
            fn = lambda *a: kernel(*a, interpret=False, **options)  # noqa: E731
        elif options:
            from pallas_kernels.prefill import ragged_paged_attention_pallas

            fn = lambda *a: ragged_paged_attention_pallas(*a, interpret=False, **options)  # noqa: E731
        else:
            fn = lambda *a: pk.ragged_paged_attention(*a, backend=args.family, interpret=False)  # noqa: E731
        inputs = (q, pages, v_pages, tables, lens, spec((args.batch + 1,), jnp.int32))
    os.environ.update(MOSAIC_GPU_DUMP_PTX="1", MOSAIC_GPU_DUMP_PTXAS="1", MOSAIC_GPU_DUMP_TO=dump_dir)
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        return jax.jit(fn).trace(*inputs).lower().compile()


def report_triton(compiled, kernel: str, keep: str | None) -> None:
    from jax.experimental import serialize_executable

    cubin = find_cubin(serialize_executable.serialize(compiled)[0], kernel)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(keep or tmp, f"{kernel}.cubin")
        open(path, "wb").write(cubin)
        env = dict(os.environ, PATH=os.path.dirname(_tool("nvdisasm")) + os.pathsep + os.environ.get("PATH", ""))
        cuobjdump = _tool("cuobjdump")
        sass = subprocess.run([cuobjdump, "-sass", path], env=env, capture_output=True, text=True, check=True).stdout
        usage = subprocess.run([cuobjdump, "-res-usage", path], env=env, capture_output=True, text=True).stdout
    if keep:
        open(os.path.join(keep, f"{kernel}.sass"), "w").write(sass)
    print(" ".join(line.strip() for line in usage.splitlines() if "REG:" in line))
    for n, loop in enumerate(sass_loops(sass)):
        waits = sorted({op for op in loop if op.startswith("DEPBAR")})
        print(f"\nloop {n}: {len(loop)} instructions; waits: {', '.join(waits) or 'none'}")
        for name, count in classify(loop):
            print(f"  {count:5d}  {name}")


def report_mosaic(dump_dir: str) -> None:
    for ptx in sorted(glob.glob(os.path.join(dump_dir, "*.ptx"))):
        text = open(ptx).read()
        ops = collections.Counter(re.findall(r"^\s+(?:@%?!?\w+\s+)?([a-z][\w.:]*)", text, re.M))
        report = ptx[:-4] + ".ptxas"
        regs = re.findall(r"Used \d+ registers[^\n]*", open(report).read()) if os.path.exists(report) else []
        resources = glob.glob(ptx[:-4] + ".resources.txt")
        smem = re.findall(r"smem_scratch_bytes=(\d+)", open(resources[0]).read()) if resources else []
        print(f"\n{os.path.basename(ptx)}: {sum(ops.values())} PTX instructions; {'; '.join(regs)}"
              f"{'; shared memory ' + smem[0] + ' B' if smem else ''}")
        for op, n in ops.most_common(40):
            print(f"  {n:5d}  {op}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", choices=("pallas", "mosaic"), default="pallas")
    parser.add_argument("--phase", choices=("decode", "prefill"), default="decode")
    parser.add_argument("--pages", choices=("bf16", "e4m3", "e5m2"), default="bf16",
                        help="KV page dtype ('bf16': the query's dtype)")
    parser.add_argument("--dtype", default="bfloat16", help="the query's dtype")
    parser.add_argument("--target", choices=sorted(TARGETS), default="h200")
    parser.add_argument("--target-config", help="an XLA GPU target config file instead of ../shared/gpu_targets'")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--option", action="append", default=[],
                        help="KEY=VALUE for the Triton decode kernel (num_stages=3) or a Mosaic kernel "
                             "(block_keys=128, mask_diagonal_only=1, wide=1: prefill); v_transposed=1: V pages "
                             "stored [head_dim, page_size] (either family)")
    parser.add_argument("--keep", help="a directory for the cubin, SASS and Mosaic dumps")
    args = parser.parse_args(argv)
    if args.keep:
        os.makedirs(args.keep, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        dump_dir = args.keep or tmp
        compiled = compile_kernel(args, dump_dir)
        print(f"{args.family} {args.phase}, {args.pages} pages, {args.dtype} q, batch {args.batch} x "
              f"{args.context}, heads {args.heads}/{args.kv_heads}, head_dim {args.head_dim}, page "
              f"{args.page_size}, for {args.target} {' '.join(args.option)}")
        if args.family == "pallas":
            report_triton(compiled, "jpaged_decode" if args.phase == "decode" else "jpaged_ragged_prefill", args.keep)
        else:
            report_mosaic(dump_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
