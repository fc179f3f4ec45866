"""The CUDA graph path of the decode step (``DecodeGraphs``): one graph per batch-size bucket, captured on first use,
replayed every step, writing one logits buffer. Block tables and lengths are static inputs (full-width tables), so
there is no graph per length. The graphs and their pool live for one ``generate`` call.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class DecodeGraphs:
    """The decode step's CUDA graphs of one call, keyed by batch bucket ``S_b``, and the ``[R, V]`` logits buffer
    they write. ``forward(S_b)`` runs the decode forward on rows ``[0, S_b)`` of the call's static inputs and
    returns its logits ``[S_b, V]``."""

    def __init__(self, forward: Callable[[int], torch.Tensor], R: int, vocab_size: int, device: torch.device):
        self.forward = forward
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self.logits_RV = torch.empty(R, vocab_size, device=device)

    def step(self, S_b: int) -> torch.Tensor:
        """Replay the graph of bucket ``S_b`` (captured first if new); returns the logits ``[S_b, V]`` (a view of the
        one buffer: read before the next step)."""
        if S_b not in self.graphs:
            self.graphs[S_b] = self._capture(S_b)
        self.graphs[S_b].replay()
        return self.logits_RV[:S_b]

    def _capture(self, S_b: int) -> torch.cuda.CUDAGraph:
        """Capture the decode forward for batch bucket ``S_b``, writing the one logits buffer. Warm-up runs recompute
        the current step's K/V: harmless."""

        def forward():
            self.logits_RV[:S_b].copy_(self.forward(S_b))

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            forward()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            forward()
        return graph
