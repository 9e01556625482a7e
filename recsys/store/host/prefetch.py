"""A software prefetch hint for numba kernels that walk rows in a data-dependent order.

The store's random-access kernels (the key map's probe, the optimizers' row updates) visit
rows in the batch's order, not memory's: over tables of a million rows nearly every visit
misses the caches, and the address of a visit a few iterations on is known long before.
``prefetch(arr, i)`` asks for row ``i``'s first cache line that early. It changes no value,
only timing; on a target without a prefetch instruction LLVM drops it.

Inside a training run (``recsys bench train``'s job) the hints shorten both the probe and the
row-wise Adagrad update (docs/benchmarks-history.md has the figures).

Write the hint inline in the kernel's loop: moved into a helper function (inlined by numba
or called), the same hint made the Adagrad loop slower than no hint at all.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

# How many keys / rows ahead the kernels ask. The kernels compile these in, and numba's
# on-disk cache keys on the kernel's own file only: after changing them here, delete the
# ``*.nbi`` / ``*.nbc`` files under ``recsys/store/tables/__pycache__`` (or touch the files
# that import them: keymap.py, optim.py, table.py).
KEYS_AHEAD = 12
ROWS_AHEAD = 8


@intrinsic
def prefetch(typingctx, arr, idx):
    """Hint the cache line of ``arr[idx]`` (1-D) or ``arr[idx, 0]`` (2-D, C order), to be
    written: every caller updates the line it asks for, so it is fetched for ownership.

    ``idx`` must be a valid index: the address is formed, not checked (a prefetch of a bad
    address does not fault, but its caller has a bug)."""
    if not isinstance(arr, types.Array) or arr.ndim not in (1, 2) or not isinstance(idx, types.Integer):
        return None
    sig = types.void(arr, idx)

    def codegen(context, builder, signature, args):
        aryty = signature.args[0]
        ary = context.make_array(aryty)(context, builder, args[0])
        index = context.cast(builder, args[1], signature.args[1], types.intp)
        zero = context.get_constant(types.intp, 0)
        ptr = cgutils.get_item_pointer(context, builder, aryty, ary, [index, zero][: aryty.ndim])
        i8p = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")
        # write (1; a CPU without a write prefetch gets a read one), keep in every cache
        # level (3), data cache (1)
        builder.call(fn, [builder.bitcast(ptr, i8p), ir.Constant(i32, 1), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return sig, codegen
