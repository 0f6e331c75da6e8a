"""Shared-memory staging primitives for a multi-stage tensor-core GEMM: cp.async and ldmatrix (sm_80 and later).

``cp_async_16(dst, d, src, s, valid)``: one thread copies 16 bytes from global memory into shared memory
without passing through registers: src[s : s + e] into dst[d : d + e], e = 16 / itemsize elements of the
arrays' common dtype (8 bf16, or 2 uint64 words); with valid False it writes 16 zero bytes and reads
nothing. The copy is asynchronous: a thread groups the copies it has issued with ``cp_async_commit()``, and
``cp_async_wait(n)`` (a device function per n) returns once at most n of its groups are still in flight.
Only the thread's own copies are waited for, so a block barrier must follow before other threads read what
landed. Both addresses must be 16-byte aligned: indices multiples of e, in dynamic shared memory (aligned
for this) or a static array declared with alignment=16 (a keyword the simulator refuses). src is indexed
flat: pass a 1-D array.

``ldmatrix_x4(sh, i)``: the 32 lanes of a warp load four 8 x 8 matrices of bf16 from shared memory in one
instruction. Lanes 8 q .. 8 q + 7 each give the index of one row of matrix q (8 consecutive bf16, 16
bytes); lane (g, t) = (lane // 4, lane % 4) gets register q = row g, elements 2t and 2t + 1 of matrix q (the
smaller index in the low 16 bits). That is exactly the per-lane layout of an mma.m16n8k16 fragment
(cuda_kernels/mma.py): four matrices give a whole A fragment (16 x 16), or the B fragments of two n8 tiles.

``ldmatrix_x4_trans(sh, i)``: the same four matrices, transposed on the way: lane (g, t) gets register q =
elements 2t and 2t + 1 of column g of matrix q (rows 2t and 2t + 1). With a matrix's rows along an mma's k
(a V tile stored key by key), that is the B fragment of k = rows, n = columns.

Helpers for the kernels built on them (gemm_pipelined, gemm_wgmma, cuda_kernels/wgmma.py): ``slab_issuer``
(a thread's cp.async copies of one K slab from its staging map), ``shared_address(sh)`` (the 32-bit
shared-window address of a shared array, which descriptors and alignment need), and on the GPU
``ptx_statement(text)`` (one operand-free PTX statement as a device function: commit, waits, fences),
``volatile_asm`` (the inline-assembly constructor all of them use) and, for intrinsics of other modules
(cuda_kernels/tma.py), ``element_pointer`` and ``shared_pointer_address``.

Two implementations, chosen at import time:
- GPU: Numba ``@intrinsic`` functions emitting the PTX (``cp.async.cg.shared.global``, ``cp.async.commit_group``,
  ``cp.async.wait_group``, ``ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16``) as volatile inline assembly with
  a memory clobber, so that the compiler neither merges them nor moves shared-memory accesses across them.
  A shared-memory operand is the 32-bit shared-window address of the array element: the array's generic
  data pointer, address-space-cast to shared.
- Numba's CUDA simulator, where ``@intrinsic`` raises: the copy is done at once (commit and wait are then
  no-ops), and ldmatrix is emulated with the same per-lane semantics: every lane writes its row index to a
  per-warp shared scratch, the block synchronises, every lane gathers its four registers from the rows the
  other lanes named, and the block synchronises again before the scratch can be reused.
Rules for callers of ldmatrix_x4 and ldmatrix_x4_trans: all 32 lanes of every warp of the block call it, the
same number of times (the instruction is warp-wide; the emulation synchronises the block), and blocks are at
most 1024 threads.
"""

from functools import lru_cache

from numba import cuda, int64, uint16, uint32

from cuda_kernels import compat  # noqa: F401  (must precede the numba.cuda import)
from cuda_kernels.compat import SIMULATOR
from cuda_kernels.primitives import WARP

CHUNK = 8   # bf16 per cp.async (16 bytes) and per ldmatrix row
COPY_BYTES = 16

if SIMULATOR:
    _MAX_WARPS = 32   # 1024 threads

    @cuda.jit(device=True)
    def cp_async_16(dst, d, src, s, valid):
        """The 16 bytes src[s : s + e] -> dst[d : d + e] (e elements of their dtype), or zeros when not valid;
        done at once in the simulator."""
        for j in range(COPY_BYTES // dst.dtype.itemsize):
            dst[d + j] = src[s + j] if valid else dst.dtype.type(0)

    @cuda.jit(device=True)
    def cp_async_commit():
        """No-op in the simulator: its copies are already done."""

    @cuda.jit(device=True)
    def shared_address(sh):
        """The simulator's shared arrays have no addresses: offsets count from 0, already aligned."""
        return uint32(0)

    @lru_cache(maxsize=None)
    def cp_async_wait(n: int):
        @cuda.jit(device=True)
        def wait():
            """No-op in the simulator."""

        return wait

    @cuda.jit(device=True)
    def _ldmatrix_emulated(sh, i, trans):
        rows = cuda.shared.array((_MAX_WARPS, WARP), int64)
        tid = cuda.threadIdx.x + cuda.blockDim.x * (cuda.threadIdx.y + cuda.blockDim.y * cuda.threadIdx.z)
        warp, lane = tid // WARP, tid % WARP
        rows[warp, lane] = i
        cuda.syncthreads()
        g, c = lane // 4, 2 * (lane % 4)
        regs = cuda.local.array(4, uint32)
        for q in range(4):
            if trans:   # column g, rows c and c + 1
                lo, hi = sh[rows[warp, 8 * q + c] + g], sh[rows[warp, 8 * q + c + 1] + g]
            else:       # row g, elements c and c + 1
                lo, hi = sh[rows[warp, 8 * q + g] + c], sh[rows[warp, 8 * q + g] + c + 1]
            regs[q] = uint32(lo) | (uint32(hi) << uint32(16))
        cuda.syncthreads()  # every lane has read the scratch: the next call may overwrite it
        return regs[0], regs[1], regs[2], regs[3]

    @cuda.jit(device=True)
    def ldmatrix_x4(sh, i):
        """(r0, r1, r2, r3) for this lane: r_q = row lane // 4 of matrix q, elements 2 (lane % 4) and + 1,
        where lane 8 q + r gave the index of that matrix's row r (see the module docstring)."""
        return _ldmatrix_emulated(sh, i, False)

    @cuda.jit(device=True)
    def ldmatrix_x4_trans(sh, i):
        """(r0, r1, r2, r3) for this lane: r_q = column lane // 4 of matrix q, rows 2 (lane % 4) and + 1."""
        return _ldmatrix_emulated(sh, i, True)

else:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    _I32, _I64 = ir.IntType(32), ir.IntType(64)

    def element_pointer(context, builder, arrty, arr, index):
        """The generic pointer to arr[index] (a C-contiguous 1-D array)."""
        data = context.make_array(arrty)(context, builder, arr).data
        return builder.gep(data, [index])

    def shared_pointer_address(builder, pointer):
        """A generic pointer into shared memory -> its 32-bit address in the shared window."""
        pointee = getattr(pointer.type, "pointee", None)
        shared_type = ir.PointerType(pointee, 3) if pointee is not None else ir.PointerType(addrspace=3)
        shared = builder.addrspacecast(pointer, shared_type)
        return builder.trunc(builder.ptrtoint(shared, _I64), _I32)

    def volatile_asm(fnty, asm, constraints):
        """llvmlite inline assembly of type fnty, volatile and with a memory clobber."""
        # NOTE: side_effect (volatile) and the memory clobber keep the copies, waits and shared loads in
        # program order with the block barriers and with each other.
        return ir.InlineAsm(fnty, asm, constraints + ",~{memory}" if constraints else "~{memory}",
                            side_effect=True)

    @intrinsic
    def _cp_async_asm(typingctx, dst, d, src, s, nbytes):
        sig = types.void(dst, types.int64, src, types.int64, types.uint32)

        def codegen(context, builder, signature, args):
            dst_ptr = element_pointer(context, builder, signature.args[0], args[0], args[1])
            src_ptr = element_pointer(context, builder, signature.args[2], args[2], args[3])
            asm = volatile_asm(ir.FunctionType(ir.VoidType(), [_I32, _I64, _I32]),
                            "cp.async.cg.shared.global [$0], [$1], 16, $2;", "r,l,r")
            builder.call(asm, [shared_pointer_address(builder, dst_ptr), builder.ptrtoint(src_ptr, _I64),
                               args[4]])
            return context.get_dummy_value()

        return sig, codegen

    @cuda.jit(device=True, inline=True)
    def cp_async_16(dst, d, src, s, valid):
        """The 16 bytes src[s : ...] -> dst[d : ...] (indices in elements of their dtype), or zeros when not
        valid, asynchronously (see the module docstring)."""
        # with a source size of 0 bytes the instruction reads nothing and fills the 16 bytes with zeros
        _cp_async_asm(dst, int64(d), src, int64(s), uint32(16) if valid else uint32(0))

    @intrinsic
    def _shared_address_asm(typingctx, sh):
        def codegen(context, builder, signature, args):
            pointer = element_pointer(context, builder, signature.args[0], args[0], ir.Constant(_I64, 0))
            return shared_pointer_address(builder, pointer)

        return types.uint32(sh), codegen

    @cuda.jit(device=True, inline=True)
    def shared_address(sh):
        """The 32-bit shared-window address of sh[0] (sh: a 1-D shared array)."""
        return _shared_address_asm(sh)

    @lru_cache(maxsize=None)
    def ptx_statement(text: str):
        """A device function that executes one operand-free PTX statement (volatile, with a memory clobber: it
        stays in program order with the shared-memory accesses and barriers around it)."""
        @intrinsic
        def statement_asm(typingctx):
            def codegen(context, builder, signature, args):
                builder.call(volatile_asm(ir.FunctionType(ir.VoidType(), []), text, ""), [])
                return context.get_dummy_value()

            return types.void(), codegen

        @cuda.jit(device=True, inline=True)
        def statement():
            statement_asm()

        return statement

    cp_async_commit = ptx_statement("cp.async.commit_group;")   # close this thread's current group of copies

    def cp_async_wait(n: int):
        """A device function that waits until at most n of this thread's cp.async groups are in flight."""
        if n < 0:
            raise ValueError(f"cp_async_wait: n must be >= 0, got {n}")
        return ptx_statement(f"cp.async.wait_group {n};")

    def _ldmatrix_intrinsic(instruction):
        @intrinsic
        def ldmatrix_asm(typingctx, sh, i):
            sig = types.UniTuple(types.uint32, 4)(sh, types.int64)

            def codegen(context, builder, signature, args):
                pointer = element_pointer(context, builder, signature.args[0], *args)
                address = shared_pointer_address(builder, pointer)
                asm = volatile_asm(ir.FunctionType(ir.LiteralStructType([_I32] * 4), [_I32]),
                                f"{instruction} {{$0, $1, $2, $3}}, [$4];", "=r,=r,=r,=r,r")
                regs = builder.call(asm, [address])
                return context.make_tuple(builder, signature.return_type,
                                          [builder.extract_value(regs, q) for q in range(4)])

            return sig, codegen

        return ldmatrix_asm

    _ldmatrix_asm = _ldmatrix_intrinsic("ldmatrix.sync.aligned.m8n8.x4.shared.b16")
    _ldmatrix_trans_asm = _ldmatrix_intrinsic("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16")

    @cuda.jit(device=True, inline=True)
    def ldmatrix_x4(sh, i):
        """(r0, r1, r2, r3) for this lane (see the module docstring); i: this lane's row index in sh."""
        return _ldmatrix_asm(sh, int64(i))

    @cuda.jit(device=True, inline=True)
    def ldmatrix_x4_trans(sh, i):
        """(r0, r1, r2, r3) for this lane, each matrix transposed (see the module docstring)."""
        return _ldmatrix_trans_asm(sh, int64(i))


@lru_cache(maxsize=None)
def slab_issuer(slab_k: int):
    """A device function ``issue(src, sh, base, k0, K, chunks, cmap)`` for the tiled GEMMs that stage K slabs of
    slab_k elements: cp.async this thread's `chunks` chunks of the slab at k0 into the stage at element offset
    base of sh. cmap (chunks, 3) int64 is one operand's staging map: per chunk its offset in a stage (-1: no
    chunk), its flat source offset at k = 0 (-1: a row past the operand, copied as zeros) and its k within the
    slab (chunks past K are zeros too; interior slabs skip that check)."""
    @cuda.jit(device=True)
    def issue(src, sh, base, k0, K, chunks, cmap):
        whole = k0 + slab_k <= K
        for e in range(chunks):
            d = cmap[e, 0]
            if d >= 0:
                s0 = cmap[e, 1]
                valid = s0 >= 0 and (whole or k0 + cmap[e, 2] < K)
                cp_async_16(sh, base + d, src, s0 + k0 if valid else 0, valid)

    return issue


# ---------------------------------------------------------------------------------------------------------
# kernels: the two primitives alone, for the tests

_wait_all = cp_async_wait(0)


_COPY_TEST_ELEMENTS = 256 * CHUNK   # NOTE: a named constant: cuda.shared.array takes no expression on the GPU


@cuda.jit
def _copy_rows_kernel(src, valid, dst):
    """Thread i copies chunk i of src (8 bf16) into shared memory, asynchronously (zeros where valid[i] is
    0), and after the wait and a barrier writes back the chunk of its neighbour i ^ 1, so a missing wait or
    a wrong address shows."""
    sh = cuda.shared.array(_COPY_TEST_ELEMENTS, uint16)
    i = cuda.threadIdx.x
    cp_async_16(sh, CHUNK * i, src, CHUNK * i, valid[i] != 0)
    cp_async_commit()
    _wait_all()
    cuda.syncthreads()
    j = i ^ 1
    for e in range(CHUNK):
        dst[CHUNK * i + e] = sh[CHUNK * j + e]


@cuda.jit
def _ldmatrix_kernel(sh_init, rows, trans, out):
    """One warp: shared memory <- sh_init; lane l loads with row index rows[l] (transposed if trans);
    out[l, q] = its register q."""
    sh = cuda.shared.array(1024, uint16)
    lane = cuda.threadIdx.x
    for e in range(lane, sh_init.size, WARP):
        sh[e] = sh_init[e]
    cuda.syncthreads()
    if trans:
        r0, r1, r2, r3 = ldmatrix_x4_trans(sh, rows[lane])
    else:
        r0, r1, r2, r3 = ldmatrix_x4(sh, rows[lane])
    out[lane, 0] = r0
    out[lane, 1] = r1
    out[lane, 2] = r2
    out[lane, 3] = r3


# ---------------------------------------------------------------------------------------------------------
# launchers


def copy_chunks(src, valid, dst, stream=0):
    """dst chunk i (8 bf16) <- src chunk i ^ 1, or zeros where valid[i ^ 1] == 0, through cp.async and shared
    memory. src, dst: (2 n * 8,) uint16 device arrays with 2 n <= 256 chunks; valid: (2 n,) int32."""
    n = valid.shape[0]
    if n % 2 or n > 256 or src.shape != (n * CHUNK,) or dst.shape != (n * CHUNK,):
        raise ValueError(f"copy_chunks: need an even number of chunks up to 256 and src, dst of {n} x {CHUNK} "
                         f"uint16, got valid {valid.shape}, src {src.shape}, dst {dst.shape}")
    _copy_rows_kernel[1, n, stream](src, valid, dst)


def ldmatrix(sh_init, rows, out, stream=0, trans=False):
    """One warp's ldmatrix_x4 (ldmatrix_x4_trans if trans) over shared memory initialised from sh_init
    ((<= 1024,) uint16): lane l gives row index rows[l] ((32,) int64, multiples of 8), out ((32, 4) uint32)
    gets every lane's registers."""
    if sh_init.shape[0] > 1024 or rows.shape != (WARP,) or out.shape != (WARP, 4):
        raise ValueError(f"ldmatrix: need sh_init of at most 1024 uint16, rows (32,) and out (32, 4), got "
                         f"{sh_init.shape}, {rows.shape}, {out.shape}")
    _ldmatrix_kernel[1, WARP, stream](sh_init, rows, bool(trans), out)
