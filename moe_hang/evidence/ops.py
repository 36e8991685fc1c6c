"""One vocabulary for collectives, whatever names them: the Flight Recorder's
``profiling_name`` (``nccl:all_gather_into_tensor_coalesced``, ``gloo:all_gather``), a c10d
function on a stack (``all_gather_into_tensor``), a functional-collective or DTensor/FSDP helper
(``full_tensor``, ``foreach_all_gather``), or a dtype's spelling (pure)."""

from __future__ import annotations

_OP_ALIASES = {
    "allreduce": "all_reduce", "all_reduce": "all_reduce", "allreduce_coalesced": "all_reduce",
    "all_reduce_coalesced": "all_reduce", "allgather": "all_gather", "all_gather": "all_gather",
    "allgather_base": "all_gather", "all_gather_base": "all_gather",
    "allgather_into_tensor_coalesced": "all_gather", "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather", "allgather_coalesced": "all_gather",
    "reduce_scatter": "reduce_scatter", "reduce_scatter_base": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "alltoall": "all_to_all", "alltoall_base": "all_to_all", "all_to_all": "all_to_all",
    "all_to_all_single": "all_to_all", "broadcast": "broadcast", "reduce": "reduce",
    "gather": "gather", "scatter": "scatter", "barrier": "barrier", "send": "send",
    "recv": "recv", "coalesced": "coalesced",
}

# Ops whose every member must pass the same sizes (all_to_all legitimately differs per rank).
SAME_SIZE_OPS = frozenset({"all_gather", "all_reduce", "reduce_scatter", "broadcast", "reduce"})

# c10d function name (distributed_c10d.py) -> collective op
C10D_OPS = {
    "all_reduce": "all_reduce", "all_reduce_coalesced": "all_reduce",
    "all_gather": "all_gather", "all_gather_single": "all_gather",
    "all_gather_into_tensor": "all_gather", "_all_gather_base": "all_gather",
    "all_gather_object": "all_gather", "all_gather_coalesced": "all_gather",
    "reduce_scatter": "reduce_scatter", "reduce_scatter_single": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter", "_reduce_scatter_base": "reduce_scatter",
    "all_to_all": "all_to_all", "all_to_all_single": "all_to_all",
    "broadcast": "broadcast", "broadcast_object_list": "broadcast", "reduce": "reduce",
    "gather": "gather", "scatter": "scatter", "barrier": "barrier",
    "monitored_barrier": "barrier", "send": "send", "recv": "recv", "isend": "send",
    "irecv": "recv", "batch_isend_irecv": "p2p",
}

# functional collectives / DTensor / FSDP helpers under torch/distributed -> op
HELPER_OPS = {
    "all_gather_tensor": "all_gather", "all_gather_tensor_autograd": "all_gather",
    "_to_replicate_tensor": "all_gather", "full_tensor": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter", "_reduce_shard_tensor": "reduce_scatter",
    "all_reduce": "all_reduce", "_reduce_value": "all_reduce",
    "all_to_all_single": "all_to_all", "all_to_all_single_autograd": "all_to_all",
    "foreach_all_gather": "all_gather", "wait_for_unshard": "all_gather",
    "foreach_reduce": "reduce_scatter",
}

# waiting on an async collective: the op is named by a caller
WAIT_FUNCS = ("wait_tensor", "wait", "_wait", "synchronize")

_SHORT = {"all_gather": "AG", "all_reduce": "AR", "reduce_scatter": "RS",
          "all_to_all": "A2A", "barrier": "BAR", "broadcast": "BC"}

_DTYPE_NAMES = {
    "torch.float32": "Float", "torch.float": "Float", "torch.float16": "Half",
    "torch.half": "Half", "torch.bfloat16": "BFloat16", "torch.float64": "Double",
    "torch.int64": "Long", "torch.long": "Long", "torch.int32": "Int", "torch.int": "Int",
    "torch.int8": "Char", "torch.uint8": "Byte", "torch.bool": "Bool",
}


def normalise_op(profiling_name: str) -> str:
    """``nccl:all_gather_into_tensor_coalesced`` -> ``all_gather``."""
    name = profiling_name.rsplit(":", 1)[-1].strip().lower().lstrip("_")
    return _OP_ALIASES.get(name, name or "unknown")


def short_op(op: str) -> str:
    """A column-wide name for a timeline cell (``AG``, ``AR``, ...)."""
    return _SHORT.get(op, op)


def normalise_dtype(name: str) -> str:
    """``torch.float32`` (how a rank spells it) -> ``Float`` (how the recorder does)."""
    return _DTYPE_NAMES.get(name, name)


_DTYPE_BYTES = {"Float": 4, "Double": 8, "Half": 2, "BFloat16": 2, "Long": 8, "Int": 4,
                "Short": 2, "Char": 1, "Byte": 1, "Bool": 1}


def nbytes(sizes: list[list[int]], dtypes: list[str]) -> int | None:
    """Bytes of a collective's inputs (float32 when the dtype is not recorded)."""
    if not sizes:
        return None
    numel = 0
    for s in sizes:
        n = 1
        for d in s:
            n *= d
        numel += n
    return numel * _DTYPE_BYTES.get(normalise_dtype(dtypes[0]) if dtypes else "Float", 4)
