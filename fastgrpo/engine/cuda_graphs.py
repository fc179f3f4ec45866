"""The CUDA graph path of the decode step: one graph per batch-size bucket, captured on first use, replayed every
step, writing one logits buffer (``_GraphSteps``, a mixin of ``fastgrpo.engine.engine._Run``). Off CUDA, or with
``cuda_graphs=False``, the step runs the decode forward eagerly. The graphs and their pool live for one
``generate`` call.
"""

from __future__ import annotations

import torch

from fastgrpo.engine.cache import _KVCache


class _GraphSteps:
    """The ``_Run`` decode step, through a CUDA graph when ``use_graphs``."""

    def _step(self, cache: _KVCache, S_b: int, n_pages: int) -> torch.Tensor:
        st = self.st
        if not self.use_graphs:
            return self.e._decode_forward(
                self.ops, cache, st.tok[:S_b], st.pos[:S_b], st.table[:S_b, :n_pages], self.cos_TD, self.sin_TD,
                self.dtype,
            )  # fmt: skip
        if S_b not in self.graphs:
            self.graphs[S_b] = self._capture(cache, S_b)
        self.graphs[S_b].replay()
        return self.logits_RV[:S_b]

    def _capture(self, cache: _KVCache, S_b: int):
        """Capture the decode forward for batch bucket ``S_b`` (full-width block tables: no per-length graph),
        writing the one logits buffer. Warm-up runs recompute the current step's K/V: harmless."""
        st = self.st

        def forward():
            logits = self.e._decode_forward(
                self.ops, cache, st.tok[:S_b], st.pos[:S_b], st.table[:S_b], self.cos_TD, self.sin_TD, self.dtype
            )
            self.logits_RV[:S_b].copy_(logits)

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            forward()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            forward()
        return graph
