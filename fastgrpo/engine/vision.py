"""Images in the engine's prompts (vision-language models, ``fastgrpo.models.vlm``): the vision tower once per prompt,
its embeddings at the image tokens, and M-RoPE's 3-D positions in prefill and decode.

One call's images (:class:`CallVision`, made by ``GenerationEngine.generate(..., images=)``):

- **Once per prompt.** A prompt's images go through the vision tower the first time one of its sequences is
  prefilled; the embeddings ``[image tokens, H]`` are kept for the call and reused by every later prefill of that
  prompt: its group's ``n`` samples share the prompt's pages (prefilled once, as for text), and a sample preempted
  and recomputed (prompt + its tokens prefilled again into private pages), or a prompt prefilled again after the
  scheduler released its pages under memory pressure, reads the kept embeddings instead of running the tower again.
  Memory: image tokens x H in the activations' dtype per prompt for the call (Qwen2.5-VL-3B, bf16: 4 KiB per image
  token, 0.7 MiB for a 187-token CLEVR image, 11% of the 36 KiB per token its K/V take; 16 prompts of one image per
  rank: 12 MiB), freed when the call returns. Recomputing instead would run the tower again per recompute.
- **Prefill.** The packed prefill's embeddings are the token embeddings with the image tokens' rows replaced by the
  tower's output, in order; its rotary cos/sin per token are read from the call's 1-D tables per frequency band at
  the position of that band's stream (M-RoPE: cos[n, j] = cos_table[pos[stream(j), n], j]), the same values the
  model's rotary embedding computes for the 3-D positions. A recompute's generated tokens sit at
  ``cache index + rope_delta`` in all three streams.
- **Decode** is text only: each row's rotary position is its cache position plus its prompt's ``rope_delta``
  (``RowState.rope``), an offset per row, so the decode step (and its CUDA graphs) stays one gather of the tables.

In a session (``fastgrpo.engine.session``) the prompts come in over time (:meth:`CallVision.add`); a prompt's
embeddings and positions are freed when its group finishes (:meth:`CallVision.release`), so the session holds those
of its in-flight prompts only, and ``update(recompute_kv=True)`` recomputes them with the K/V
(:meth:`CallVision.forget_embeddings`).

Tensor names carry their shape: N packed tokens, H hidden, D head dim, I images, L a prompt's tokens.
"""

from __future__ import annotations

import torch

from fastgrpo.models.vlm import (
    ImageInputs,
    ImagePrompt,
    image_embeddings,
    image_token_id,
    image_tokens,
    rope_positions,
    text_decoder,
)


def prompt_images(prompt_token_ids, images):
    """The images a ``generate`` call or a session's ``add`` runs with: ``images`` as given, else those the prompts
    carry (:class:`fastgrpo.models.vlm.ImagePrompt`, the data layer's), else None (text)."""
    if images is None and any(isinstance(p, ImagePrompt) for p in prompt_token_ids):
        return [p.images if isinstance(p, ImagePrompt) else None for p in prompt_token_ids]
    return images


class CallVision:
    """The images of one call's prompts (module docstring): ``images[p]`` (None: a text prompt) for prompt ``p``.

    Raises ``ValueError`` naming the prompt when its count of image tokens differs from its images'.
    """

    def __init__(self, model, prompts: list[list[int]], images: list[ImageInputs | None], cos_TD: torch.Tensor,
                 sin_TD: torch.Tensor):
        self.model = model
        self.images: list[ImageInputs | None] = []
        self.cos_TD, self.sin_TD = cos_TD, sin_TD
        self.tower_calls = 0  # vision-tower runs (one per prompt with images, per call)
        self.image_tokens = 0  # image tokens the tower produced
        self.embeds: dict[int, torch.Tensor] = {}  # prompt -> [image tokens, H]
        self.positions: list[torch.Tensor | None] = []  # per prompt [3, L] (None: released)
        self.deltas: list[int] = []
        self.image_id = image_token_id(model)
        rotary = text_decoder(model).rotary_emb
        sections = list(rotary.mrope_section)
        half = sum(sections)
        band = torch.cat([torch.full((s,), i % 3) for i, s in enumerate(sections)])  # [D / 2]: stream of each band
        self.band_D = torch.cat([band, band]).to(cos_TD.device)  # [D] (rotate_half's two halves)
        if 2 * half != cos_TD.shape[1]:
            raise ValueError(f"model: mrope_section {sections} does not cover the head dim {cos_TD.shape[1]}")
        self.add(prompts, images, 0)

    def check(self, prompts: list[list[int]], images: list[ImageInputs | None], first: int) -> None:
        """Raise ``ValueError`` naming prompt ``first + i`` when its image tokens are not as many as its images make."""
        merge = self.model.config.vision_config.spatial_merge_size
        for i, (p, im) in enumerate(zip(prompts, images)):
            have = sum(t == self.image_id for t in p)
            want = 0 if im is None else sum(image_tokens(im.grid_thw, merge))
            if have != want:
                raise ValueError(f"prompt {first + i} has {have} image tokens but its images make {want} "
                                 f"(grid_thw {None if im is None else im.grid_thw.tolist()})")

    def add(self, prompts: list[list[int]], images: list[ImageInputs | None], first: int) -> None:
        """Check the images of prompts ``first, first + 1, ...`` (a session's next ones) and compute their M-RoPE
        positions; nothing is added when a check fails."""
        self.check(prompts, images, first)
        self.images += images
        for p, im in zip(prompts, images):
            pos_3L, delta = rope_positions(self.model, p, None if im is None else im.grid_thw)
            self.positions.append(pos_3L.to(self.cos_TD.device))
            self.deltas.append(delta)

    def release(self, p: int) -> None:
        """Prompt ``p``'s group has finished (a session): no sequence of it is prefilled again; free its images,
        kept embeddings and positions."""
        self.embeds.pop(p, None)
        self.positions[p] = None
        self.images[p] = None

    def state(self, keys) -> dict[int, dict[str, torch.Tensor]]:
        """The images of prompts ``keys`` (a session's unfinished groups) as plain tensors, for a checkpoint."""
        return {p: {"pixel_values": im.pixel_values.cpu(), "grid_thw": im.grid_thw.cpu()} for p in keys
                if (im := self.images[p]) is not None}

    def restore(self, added: int, prompts: dict[int, list[int]], images: dict[int, dict]) -> None:
        """Take back :meth:`state` into a fresh session's vision: ``added`` prompts so far, of which ``prompts``
        (key -> ids) are unfinished; their positions are computed again, their tower output at first use."""
        if self.images:
            raise RuntimeError("CallVision.restore needs a fresh session's vision (no prompt added)")
        self.images = [None] * added
        self.positions = [None] * added
        self.deltas = [0] * added
        for p, ids in prompts.items():
            im = images.get(p)
            self.images[p] = im = None if im is None else ImageInputs(im["pixel_values"], im["grid_thw"])
            self.check([ids], [im], p)
            pos_3L, self.deltas[p] = rope_positions(self.model, ids, None if im is None else im.grid_thw)
            self.positions[p] = pos_3L.to(self.cos_TD.device)

    def forget_embeddings(self) -> None:
        """The weights changed and every K/V is recomputed (``GenerationSession.update(recompute_kv=True)``): the
        kept tower outputs are recomputed too (a trainable tower changed with them)."""
        self.embeds.clear()

    def stats(self) -> dict:
        return dict(vision_tower_calls=self.tower_calls, vision_image_tokens=self.image_tokens)

    def prompt_embeds(self, p: int) -> torch.Tensor | None:
        """Prompt ``p``'s image embeddings ``[image tokens, H]``: the tower's output, run on its first use."""
        im = self.images[p]
        if im is None:
            return None
        if p not in self.embeds:
            dev = self.cos_TD.device
            self.embeds[p] = image_embeddings(self.model, im.pixel_values.to(dev), im.grid_thw.to(dev))
            self.tower_calls += 1
            self.image_tokens += self.embeds[p].shape[0]
        return self.embeds[p]

    def prefill_inputs(self, seqs: list[tuple[list[int], int]], tokens_N: torch.Tensor):
        """The packed prefill's inputs for ``(tokens, prompt)`` sequences packed as ``tokens_N`` (each a prompt's
        tokens, maybe followed by generated ones): embeddings ``[N, H]`` with the image tokens' rows from the tower,
        and per-token cos/sin ``[N, D]`` at their M-RoPE positions (the rotary then reads them at ``arange(N)``)."""
        embed = text_decoder(self.model).embed_tokens
        x_NH = embed(tokens_N)
        pos, start = [], 0
        for toks, p in seqs:
            L = self.positions[p].shape[1]
            extra = torch.arange(L, len(toks), device=tokens_N.device) + self.deltas[p]  # generated: text positions
            pos.append(torch.cat([self.positions[p], extra.expand(3, -1)], dim=1))  # [3, len]
            e = self.prompt_embeds(p)
            if e is not None:
                at = torch.nonzero(tokens_N[start : start + L] == self.image_id).flatten() + start
                x_NH[at] = e.to(x_NH.dtype)
            start += len(toks)
        pos_3N = torch.cat(pos, dim=1)
        idx_ND = pos_3N[self.band_D].t()  # [N, D]: the position of each column's stream
        return x_NH, self.cos_TD.gather(0, idx_ND), self.sin_TD.gather(0, idx_ND)
