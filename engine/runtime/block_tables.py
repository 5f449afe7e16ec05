"""Each sequence's block table as the attention kernels read it: the planner's grants
(``engine/core/blocks.py``) mirrored into one int32 tensor, ``[max_sequences, blocks per longest sequence]``,
updated in place as blocks are added, so a step's tables are one index of it."""

from __future__ import annotations

import torch

from engine.core.block_pool import BlockPool
from engine.core.blocks import BlockLedger, LowerTier


class BlockTables(BlockLedger):
    def __init__(
        self,
        pool: BlockPool,
        max_sequences: int,
        max_positions: int,
        device: torch.device,
        caching: bool = True,
        lower: LowerTier | None = None,
    ) -> None:
        super().__init__(pool, max_sequences, caching, lower)
        self.table = torch.zeros(max_sequences, -(-max_positions // self.block_size), dtype=torch.int32, device=device)

    def _assign(self, row: int, index: int, block: int) -> None:
        self.table[row, index] = block

    def rows(self, rows: list[int], positions: int) -> torch.Tensor:
        """The tables of ``rows`` (one per packed row of a step), wide enough for ``positions`` positions."""
        index = torch.tensor(rows, dtype=torch.long, device=self.table.device)
        return self.table[index, : self.blocks_for(positions)]
