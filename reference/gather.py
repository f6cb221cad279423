"""Row gathers: what a step builder reads from its tables (embeddings, page-table rows, RoPE rows) by index."""
import torch

from reference.checks import check_tensor


def check_pairs(tables, indices) -> int:
    """Raises ValueError naming the bad argument unless tables[k] (rows_k, width_k) and indices[k] (B,) int32/int64
    (contiguous, one length B for all) pair up on one device; returns B."""
    if not tables or len(tables) != len(indices):
        raise ValueError(f"tables and indices must pair up, got {len(tables)} tables and {len(indices)} index tensors")
    device = tables[0].device if isinstance(tables[0], torch.Tensor) else None
    for k, (table, index) in enumerate(zip(tables, indices)):
        check_tensor(f"tables[{k}]", table, ndim=2, device=device)
        check_tensor(f"indices[{k}]", index, ndim=1, dtype=(torch.int32, torch.int64), device=device,
                     contiguous=True)
        if index.numel() != indices[0].numel():
            raise ValueError(f"indices[{k}] has {index.numel()} entries, indices[0] {indices[0].numel()}")
    return indices[0].numel()


def gather_rows(tables, indices) -> list[torch.Tensor]:
    # tables[k]: (rows_k, width_k), indices[k]: (B,) int -> [(B, width_k)]: tables[k][indices[k]]
    check_pairs(tables, indices)
    for k, (table, index) in enumerate(zip(tables, indices)):
        if index.numel() and (int(index.min()) < 0 or int(index.max()) >= table.shape[0]):
            raise ValueError(f"indices[{k}] must lie in [0, {table.shape[0]}), got {int(index.min())}.."
                             f"{int(index.max())}")
    return [table.index_select(0, index) for table, index in zip(tables, indices)]
