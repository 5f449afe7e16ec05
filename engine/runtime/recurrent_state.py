"""What a hybrid model keeps per sequence beside its KV blocks: the state of its recurrent layers: each layer's
last ``span - 1`` inputs of its short convolution (LFM2's ``B * x``; Qwen3.5's linear attention's query, key and
value), and for Qwen3.5 each value head's matrix of its gated delta rule (``engine/runtime/delta_rule.py``).

Memory. One tensor per model, ``[layers, sequence slots, span - 1, channels]`` in the model's dtype (and the
matrices' ``[layers, slots, heads, key dim, value dim]`` in float32): a slot per
sequence the engine holds at once (its block table's row, ``engine/core/blocks.py``), so admission, which already
takes a row, takes its state too, and a finished sequence's row (and state) is free again. A sequence's state is
never read at its first position: a sequence starting at position 0 (admitted, or preempted or parked and
recomputing) starts from zeros, whatever its slot held before.

Exactness. A row's convolution is the same few products and sums, in the same order, whatever else its step holds and
however its prompt was cut into chunks: a chunk's first rows read the inputs before it from the state, later rows
read them from the chunk itself, and both are the same values. A preempted or parked sequence recomputes its state
from its tokens, to the same bits.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from dataclasses import dataclass

import torch

from engine.runtime import delta_rule as rule
from engine.runtime import kernels, kv_disk
from engine.runtime.os_memory import lazy_zeros


@dataclass(frozen=True, slots=True)
class Segment:
    """One sequence's rows in a step: ``length`` rows from the step's row ``row``, at positions from ``start``."""

    slot: int  # the sequence's state slot (its block table's row)
    start: int
    row: int
    length: int


#: Evicted checkpoints' matrices held for reuse (beyond ``max_checkpoints``'s: at most this many more in memory).
SPARE_MATRICES = 4


class RecurrentStates:
    """Every sequence slot's recurrent state, for every recurrent layer."""

    def __init__(
        self, layers: int, slots: int, channels: int, span: int, dtype: torch.dtype, device: torch.device,
        block_size: int, max_checkpoints: int = 0, matrix: tuple[int, int, int] | None = None,
    ) -> None:  # fmt: skip
        """``max_checkpoints``: states kept at cached blocks' ends, by the block's hash (the prefix cache's; the
        least recently used dropped first), so that a cached prefix resumes without recomputing; 0: none.
        ``matrix``: the delta rule's heads, key and value dims (Qwen3.5); None: convolutions only (LFM2)."""
        self.layers, self.slots, self.channels, self.span = layers, slots, channels, span
        self.dtype = dtype
        self.block_size = block_size
        self.matrix = matrix
        self.state = lazy_zeros((layers, slots, span - 1, channels), dtype, device)
        self.matrices = lazy_zeros((layers, slots, *matrix), torch.float32, device) if matrix else None
        self.max_checkpoints = max_checkpoints
        self._checkpoints: OrderedDict[bytes, tuple[torch.Tensor, torch.Tensor | None]] = OrderedDict()
        #: Evicted checkpoints' matrices, written again by later ones (a new 54 MiB tensor a checkpoint paid its
        #: pages' faults: ~35 ms each, with 32 new prompts a step about a second).
        self._spare: list[torch.Tensor] = []
        self._float_weights: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        #: The prefix cache's disk tier for states (``kv_disk.DiskTier`` over these: a "block" is a slot's state).
        self.disk: kv_disk.DiskTier | None = None

    @staticmethod
    def bytes_per_sequence(
        layers: int, channels: int, span: int, dtype: torch.dtype, matrix: tuple[int, int, int] | None = None
    ) -> int:
        heads, keys, values = matrix or (0, 0, 0)
        return layers * ((span - 1) * channels * dtype.itemsize + heads * keys * values * 4)

    def step(self, segments: list[Segment], rows: int) -> StepStates:
        """The indexes a step's convolutions read and write through (one set for every layer)."""
        return StepStates(self, segments, rows)

    def keep(self, digest: bytes, state: torch.Tensor, matrix: torch.Tensor | None, persist: bool = False) -> None:
        """The state ``[layers, span - 1, channels]`` (and the matrices ``[layers, heads, key dim, value dim]``) at
        the end of the cached block of hash ``digest``; ``persist``: written to the disk tier too (a prompt's last
        block end's: one a prompt, not one a block a long prompt or a decoding sequence crosses)."""
        if not self.max_checkpoints:
            return
        if persist and self.disk is not None:
            self.disk.store_bytes(digest, lambda: kv_disk.to_bytes(_checkpoint_parts(state, matrix)))
        self._checkpoints[digest] = (state, matrix)
        self._checkpoints.move_to_end(digest)
        while len(self._checkpoints) > self.max_checkpoints:
            _, (_, evicted) = self._checkpoints.popitem(last=False)
            self.recycle(evicted)

    def float_weight(self, layer: int, weight: torch.Tensor) -> torch.Tensor:
        """Layer ``layer``'s convolution's ``weight`` in float32, contiguous, as the native op takes it: made once."""
        kept = self._float_weights.get(layer)
        if kept is None or kept[0] is not weight:
            kept = self._float_weights[layer] = (weight, weight.float().contiguous())
        return kept[1]

    def matrix_buffer(self) -> torch.Tensor:
        """Room for a checkpoint's matrices ``[layers, heads, key dim, value dim]``: an evicted one's, else new."""
        assert self.matrices is not None
        return self._spare.pop() if self._spare else torch.empty_like(self.matrices[:, 0])

    def recycle(self, matrix: torch.Tensor | None) -> None:
        """``matrix`` (a checkpoint's, no longer kept) for a later checkpoint to write; a few are held."""
        if matrix is not None and len(self._spare) < SPARE_MATRICES:
            self._spare.append(matrix)

    def resume(self, slot: int, digest: bytes) -> bool:
        """Put the state kept at the end of the block of hash ``digest`` into ``slot`` (from memory, else from the
        disk tier); False if none was kept."""
        kept = self._checkpoints.get(digest)
        if kept is None:
            return self.disk is not None and self.disk.load(digest, slot)
        self._checkpoints.move_to_end(digest)
        self.state[:, slot] = kept[0]
        if self.matrices is not None and kept[1] is not None:
            self.matrices[:, slot] = kept[1]
        return True

    # -- as the disk tier's blocks (``kv_disk.Blocks``): a slot's state as one run of bytes ------------------------

    def block_bytes(self) -> int:
        """A checkpoint's bytes: every layer's convolution inputs, then (the delta rule's) matrices."""
        matrices = 0 if self.matrices is None else self.matrices[:, 0].numel() * 4
        return self.state[:, 0].numel() * self.dtype.itemsize + matrices

    def read_block(self, block: int) -> torch.Tensor:
        """Slot ``block``'s state as ``write_block`` takes it back."""
        return kv_disk.to_bytes(self._parts(block))

    def write_block(self, block: int, data: torch.Tensor) -> None:
        """Slot ``block``'s state from the bytes of a checkpoint (``read_block``)."""
        kv_disk.from_bytes(data, self._parts(block))

    def _parts(self, slot: int) -> list[torch.Tensor]:
        """Slot ``slot``'s state as the disk keeps it: its convolution inputs, then (the delta rule's) matrices."""
        return _checkpoint_parts(self.state[:, slot], None if self.matrices is None else self.matrices[:, slot])

    def forget(self) -> None:
        """Drop every kept state (the prefix cache was dropped)."""
        self._checkpoints.clear()
        self._spare.clear()

    @property
    def num_checkpoints(self) -> int:
        return len(self._checkpoints)


class StepStates:
    """One step's view of the states: each row's window of inputs, and where each sequence's new state lies."""

    def __init__(self, states: RecurrentStates, segments: list[Segment], rows: int) -> None:
        keep = states.span - 1
        device = states.state.device
        self._states = states
        self._segments = segments
        self._slots = torch.tensor([s.slot for s in segments], dtype=torch.long, device=device)
        self._fresh = torch.tensor([s.start == 0 for s in segments], dtype=torch.bool, device=device)
        #: The native convolution's segments: slot, whether at its first position, first row, rows.
        self._segments_table = torch.tensor([[s.slot, s.start == 0, s.row, s.length] for s in segments],
                                            dtype=torch.long).reshape(len(segments), 4)  # fmt: skip
        # The inputs a step reads, one tensor (``_pool``): each sequence's ``keep`` past inputs (its state), then the
        # step's rows. A row at offset t of its segment reads offsets t - keep .. t: a negative one is its state's.
        self._keep, self._rows = keep, rows
        at_end: list[list[int]] = []
        #: The last block end each segment's rows reach (its index, the position), and every layer's state there.
        self.boundaries: list[tuple[int, int]] = []
        self.at_boundaries: list[torch.Tensor] = []
        #: Each boundary's matrices, every layer's written into one buffer as the layer's rule reaches it.
        self._kept_matrices: dict[tuple[int, int], torch.Tensor] = {}
        self._rule_layers = 0
        for index, segment in enumerate(segments):
            end = _block_end(segment, states.block_size) if states.max_checkpoints else None
            if end is not None:  # the state there, kept for the prefix cache
                self.boundaries.append((index, end))
                at_end.append([self._place(index, end - segment.start - keep + j) for j in range(keep)])
        self._at_end = torch.tensor(at_end, dtype=torch.long, device=device).reshape(len(at_end), keep)

    def _place(self, index: int, offset: int) -> int:
        """Where segment ``index``'s input at ``offset`` from its first row lies in the pool (``_pool``)."""
        keep = self._keep
        if offset < 0:
            return index * keep + keep + offset
        return len(self._segments) * keep + self._segments[index].row + offset

    @functools.cached_property
    def _windows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Torch's convolution's indexes into the pool (where the native op does not build): each row's window of
        inputs ``[rows, span]``, and each sequence's new state ``[segments, keep]``."""
        keep, device = self._keep, self._slots.device
        window = [[self._place(i, t - keep + k) for k in range(keep + 1)]
                  for i, segment in enumerate(self._segments) for t in range(segment.length)]  # fmt: skip
        new_state = [[self._place(i, segment.length - keep + j) for j in range(keep)]
                     for i, segment in enumerate(self._segments)]  # fmt: skip
        assert len(window) == self._rows
        windows = torch.tensor(window, dtype=torch.long, device=device).reshape(self._rows, keep + 1)
        return windows, torch.tensor(new_state, dtype=torch.long, device=device).reshape(len(self._segments), keep)

    def convolve(self, layer: int, inputs: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Layer ``layer``'s depthwise causal convolution of ``inputs`` ``[rows, channels]`` by ``weight``
        ``[channels, span]`` (its last column multiplies the row itself), each row over its own sequence's inputs;
        the sequences' states move on past the step's rows. The native op (``csrc/short_conv.cpp``) sums each
        channel in float32 and rounds once; torch's ops, where it does not build, round each product and sum."""
        state = self._states.state[layer]
        ops = kernels.native_ops() if state.device.type == "cpu" else None
        if ops is not None and inputs.dtype in (torch.float32, torch.bfloat16):
            if self.boundaries:  # the states kept for the prefix cache: read before the op moves them on
                self.at_boundaries.append(self._pool(state, inputs)[self._at_end])
            return ops.short_conv(
                state, inputs.contiguous(), self._states.float_weight(layer, weight), self._segments_table
            )
        pool = self._pool(state, inputs)  # where the native op does not build: torch's, on gathered windows
        window, new_state = self._windows
        windows = pool[window]  # [rows, span, channels]
        out = windows[:, 0] * weight[:, 0]
        for k in range(1, weight.shape[1]):  # one order of sums for every row
            out = out + windows[:, k] * weight[:, k]
        state[self._slots] = pool[new_state]
        if self.boundaries:
            self.at_boundaries.append(pool[self._at_end])  # [boundaries, keep, channels]
        return out

    def _pool(self, state: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
        """The inputs a step's windows index: each sequence's past ones (its state; zeros at its first position),
        then the step's rows."""
        past = state[self._slots]
        past[self._fresh] = 0
        return torch.cat([past.reshape(-1, inputs.shape[1]), inputs])

    def delta_rule(
        self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, decay: torch.Tensor,
        beta: torch.Tensor, correct: bool = True,
    ) -> torch.Tensor:  # fmt: skip
        """Layer ``layer``'s gated delta rule (``correct`` False: Mamba-2's scan) over the step's rows
        (``delta_rule.step``'s inputs, a row each), each sequence from its matrices; what each row's query reads,
        ``[rows, heads, value dim]`` float32. Every sequence in one native call (two where a kept block end splits
        some), each head of each sequence its own task, its positions in order: a head's sums are the same whatever
        its batchmates (a product over several sequences would sum in another order: a row's logprob moved by one
        ulp with its batchmates)."""
        matrices = self._states.matrices
        assert matrices is not None
        matrices = matrices[layer]
        ops = kernels.native_ops() if matrices.device.type == "cpu" else None
        if ops is None:
            return self._one_at_a_time(layer, matrices, (query, key, value, decay, beta), correct)
        out = torch.empty_like(value)
        inputs = [x.contiguous() for x in (query, key, value, decay, beta)]
        first, rest = self._pieces
        if not self._rule_layers and self._fresh_slots:  # every layer's matrices of the fresh sequences, at once
            self._states.matrices[:, self._fresh_slots] = 0  # type: ignore[index]
        self._rules(ops, matrices, first, inputs, correct, out)
        for i, end in self.boundaries:
            self._keep_matrix(layer, (i, end), matrices[self._segments[i].slot])
        self._rule_layers += 1
        self._rules(ops, matrices, rest, inputs, correct, out)
        return out

    @functools.cached_property
    def _fresh_slots(self) -> list[int]:
        return [segment.slot for segment in self._segments if not segment.start]

    @functools.cached_property
    def _pieces(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The native rule's pieces (slot, first row, rows), the same for every layer: each segment's rows up to its
        kept block end (the matrices there kept), then the rest; None: no piece."""
        ends = dict(self.boundaries)
        splits = [ends[i] - s.start if i in ends else s.length for i, s in enumerate(self._segments)]
        pairs = list(zip(self._segments, splits, strict=True))
        first = [(s.slot, s.row, split) for s, split in pairs if split]
        rest = [(s.slot, s.row + split, s.length - split) for s, split in pairs if s.length > split]
        return tuple(torch.tensor(p, dtype=torch.long) if p else None for p in (first, rest))  # type: ignore[return-value]

    @staticmethod
    def _rules(
        ops: object, matrices: torch.Tensor, pieces: torch.Tensor | None, inputs: list[torch.Tensor], correct: bool,
        out: torch.Tensor,
    ) -> None:  # fmt: skip
        """Several sequences' pieces in one native call (``csrc/delta_rule.cpp``'s ``delta_rules``)."""
        if pieces is not None:
            ops.delta_rules(matrices, pieces, *inputs, correct, out)  # type: ignore[attr-defined]

    def _keep_matrix(self, layer: int, boundary: tuple[int, int], matrix: torch.Tensor) -> None:
        buffer = self._kept_matrices.get(boundary)
        if buffer is None:
            buffer = self._kept_matrices[boundary] = self._states.matrix_buffer()
        buffer[layer].copy_(matrix)

    def _one_at_a_time(
        self, layer: int, matrices: torch.Tensor, inputs: tuple[torch.Tensor, ...], correct: bool
    ) -> torch.Tensor:
        """Where the native ops do not build: one sequence at a time, a position at a time (``delta_rule.step``)."""
        query, key, value, decay, beta = inputs
        out = torch.empty_like(value)
        ends = dict(self.boundaries)
        for index, segment in enumerate(self._segments):
            matrix = matrices[segment.slot]  # [heads, keys, values], moved on in place
            if not segment.start:
                matrix.zero_()
            split = ends[index] - segment.start if index in ends else segment.length
            for first, last in ((0, split), (split, segment.length)):
                rows_of = slice(segment.row + first, segment.row + last)
                if last > first:
                    out[rows_of] = self._rule(matrix, query[rows_of], key[rows_of], value[rows_of], decay[rows_of],
                                              beta[rows_of], correct)  # fmt: skip
                if first == 0 and index in ends:
                    self._keep_matrix(layer, (index, ends[index]), matrix)
        self._rule_layers += 1
        return out

    @staticmethod
    def _rule(
        matrix: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, decay: torch.Tensor,
        beta: torch.Tensor, correct: bool,
    ) -> torch.Tensor:  # fmt: skip
        """One sequence's positions through the rule, ``matrix`` moved on in place: ``delta_rule.step`` a position
        at a time."""
        state, reads = matrix[None], []
        for t in range(query.shape[0]):
            rows = slice(t, t + 1)
            state, read = rule.step(state, query[rows], key[rows], value[rows], decay[rows], beta[rows], correct)
            reads.append(read)
        matrix.copy_(state[0])
        return torch.cat(reads)

    def states_at_boundaries(self) -> list[torch.Tensor]:
        """Every layer's state at each of ``boundaries``, ``[layers, keep, channels]`` each."""
        if not self.at_boundaries:
            return []
        return list(torch.stack(self.at_boundaries).transpose(0, 1).unbind(0))

    def matrices_at(self) -> list[torch.Tensor | None]:
        """Every layer's matrices at each of ``boundaries`` (None: no delta rule)."""
        if not self._rule_layers or not self.boundaries:
            return [None] * len(self.boundaries)
        assert self._rule_layers == self._states.layers, "a step runs the rule on every recurrent layer"
        return [self._kept_matrices[boundary] for boundary in self.boundaries]


def _checkpoint_parts(state: torch.Tensor, matrix: torch.Tensor | None) -> list[torch.Tensor]:
    """A state's tensors in the order its bytes lie on disk: convolution inputs, then (the delta rule's) matrices."""
    return [state] if matrix is None else [state, matrix]


def _block_end(segment: Segment, block_size: int) -> int | None:
    """The last position past the segment's start, up to its end, where a block ends; None if none (one a step: a
    state kept at each block end of a long prompt would cost a matrix state each, for the delta rule megabytes)."""
    last = (segment.start + segment.length) // block_size * block_size
    return last if last > segment.start else None
