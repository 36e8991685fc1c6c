"""Each rank reads its own shard of records through a DataLoader with one worker process. On
rank $CULPRIT_RANK (default 1) record 37 has no 'labels' field: ``Dataset.__getitem__`` raises
``KeyError`` in the worker, and the DataLoader re-raises it in the main process as
``KeyError: Caught KeyError in DataLoader worker process 0.`` with the worker's traceback as
text. The other rank waits in that step's gradient all-reduce."""

import torch
import torch.distributed as dist
from _corpus import init, role
from torch.utils.data import DataLoader, Dataset


class Records(Dataset):
    def __init__(self, records: list[dict[str, torch.Tensor]]) -> None:
        self.records = records

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        record = self.records[i]
        if "labels" not in record:
            raise KeyError(f"sample {i}: missing 'labels' field")  # corpus: getitem
        return record["input"], record["labels"]


def load_shard(rank: int, corrupt: bool) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(rank)
    records = [{"input": torch.randn(16, generator=g), "labels": torch.randn(1, generator=g)}
               for _ in range(64)]
    if corrupt:
        del records[37]["labels"]  # a record written without its labels
    return records


if __name__ == "__main__":
    rank, world = init()
    culprit = role("CULPRIT_RANK", 1)
    loader = DataLoader(Records(load_shard(rank, rank == culprit)), batch_size=8,
                        num_workers=1)
    w = torch.zeros(16, 1)
    for x, y in loader:  # corpus: loader
        grad = x.T @ (x @ w - y) / len(x)
        dist.all_reduce(grad)  # corpus: allreduce
        w -= 0.1 * grad / world
    dist.barrier()
    dist.destroy_process_group()
