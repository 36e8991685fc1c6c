"""Which torch machinery posted a collective, read off its frames (pure): FSDP2's unshard
and gradient reduction, DTensor's gather. Below both the rank state and the advice, which
ask the same."""

from __future__ import annotations

from moe_hang.evidence.stacks import Frame


def _torch_fn(frames: list[Frame], path_part: str, names: tuple[str, ...]) -> bool:
    return any(path_part in f.file.replace("\\", "/") and f.function.rsplit(".", 1)[-1] in names
               for f in frames)


def uses_dtensor_gather(frames: list[Frame]) -> bool:
    """``DTensor.from_local(...).full_tensor()`` / ``redistribute``: no size exchange."""
    return _torch_fn(frames, "torch/distributed/tensor/", ("full_tensor", "redistribute",
                                                           "from_local", "_to_replicate_tensor"))


def fsdp_unshard(frames: list[Frame]) -> bool:
    """FSDP2's pre-forward all-gather of a module's parameters."""
    return _torch_fn(frames, "torch/distributed/fsdp/", (
        "pre_forward", "_pre_forward", "unshard", "foreach_all_gather", "wait_for_unshard",
        "_root_pre_forward", "lazy_init"))


def fsdp_reduce(frames: list[Frame]) -> bool:
    """FSDP2's gradient reduction after a module's backward (reduce-scatter, all-reduce):
    posted only where gradient sync is on (``set_requires_gradient_sync``)."""
    return _torch_fn(frames, "torch/distributed/fsdp/", ("post_backward", "foreach_reduce"))
