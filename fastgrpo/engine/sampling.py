"""Sampling for the generation engine: the request (``SamplingParams``), the result (``Completion``), the multi-turn
interface (``TurnHandler``, ``TurnResult``), each sample's random stream and the draw of one token per row
(``sample_tokens``).

With ``temperature == 0`` the token is ``argmax(logits)`` and its log-prob is ``log_softmax(logits)``.
Otherwise ``logp = log_softmax(logits / temperature)``; top-k keeps the ``k`` largest (ties with the k-th are
kept), then top-p keeps the smallest set of the most likely tokens (of the top-k renormalised distribution)
whose mass reaches ``top_p`` — the order Hugging Face's warpers apply them. The token is drawn from the truncated,
renormalised distribution. Every sample has its own random stream keyed by ``h(seed, sample, t)`` for its t-th
*sampled* token (``fastgrpo.kernels.sampling``; t counts the tokens the policy sampled in all its turns, not the
appended observations, nor the tokens drawn past a stop string and trimmed), so a sample's tokens do not depend on
the batch it runs in, its slot, ``max_batch_size``, ``sync_every``, when its turn handler answers, or whether it
was preempted, and no host sync is needed to seed them. On CUDA the draw is the Gumbel-max
trick (``argmax(logp_masked - log(-log(U)))``, ``U = U(h, v)`` philox); temperature-only sampling (no top-k/top-p,
the GRPO default) is ``fastgrpo.kernels.sampling.gumbel_sample``, one kernel that draws the noise in registers and
reads each row of logits twice. Elsewhere it is the inverse CDF with one 53-bit uniform per row, a hash of ``h``
(``inverse_cdf_sample``: fp64 CDF in two levels, no ``[S, V]`` noise). Same distribution, different draws.
The logits are accumulated and kept in fp32 (the LM head's product has an fp32 output even for bf16 weights), like
the training kernels', so no bf16 rounding happens before the softmax.
**The returned log-prob is ``logp[token]``: under the temperature-scaled distribution before top-p/top-k
truncation**, which is what the training forward computes with the same temperature.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

import torch

from fastgrpo.kernels.batch_invariant import logsumexp_tiles, token_logprobs
from fastgrpo.kernels.sampling import SEED_MASK, gumbel_sample, inverse_cdf_sample, uniform_rows
from fastgrpo.kernels.utils import use_triton


@dataclass(frozen=True)
class SamplingParams:
    """How to sample: ``n`` completions per prompt, each at most ``max_new_tokens`` long."""

    n: int = 1
    """Completions per prompt (the GRPO group size); the prompt is prefilled once for all of them."""
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy (argmax)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the most likely tokens whose probability mass reaches top_p (1 = off)."""
    top_k: int = 0
    """Keep only the k most likely tokens (0 = off)."""
    max_new_tokens: int = 256
    """Upper bound on generated tokens per completion (finish_reason "length" when reached without a stop)."""
    stop_token_ids: tuple[int, ...] = ()
    """Extra stop tokens besides the engine's eos_token_ids; the stop token is included in the output."""
    seed: int | None = None
    """Seed of the sampling generator; None draws one from torch's default generator (torch.manual_seed)."""
    max_sequence_tokens: int | None = None
    """Prompt + response budget (NeMo-RL's max_total_sequence_length; None: the model's context, which also caps it):
    each prompt's response limit is ``min(max_new_tokens, max_sequence_tokens - len(prompt))``
    (:meth:`response_limit`). Multi-turn: the budget of the whole conversation (prompt + every turn + every
    observation), and ``max_new_tokens`` is per turn."""
    stop_strings: tuple[str, ...] = ()
    """A turn (a completion) also ends when its decoded text ends with one of these (needs the engine's tokenizer);
    it ends at the token that completes the first match, included ("stop", or a turn boundary)."""
    max_turns: int = 1
    """Most sampled turns per trajectory; > 1 needs a turn handler (``generate(..., turns=)``); 1 = single-turn."""

    def __post_init__(self):
        def is_int(x):
            return isinstance(x, int) and not isinstance(x, bool)

        if not is_int(self.n) or self.n < 1:
            raise ValueError(f"SamplingParams.n must be an integer >= 1, got {self.n!r}")
        t = self.temperature
        if not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"SamplingParams.temperature must be a finite number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p!r}")
        if not is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k must be an integer >= 0, got {self.top_k!r}")
        if not is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        stops = tuple(self.stop_token_ids)
        if not all(is_int(t) and t >= 0 for t in stops):
            raise ValueError(f"SamplingParams.stop_token_ids must be token ids >= 0, got {self.stop_token_ids!r}")
        object.__setattr__(self, "stop_token_ids", stops)
        if self.seed is not None and not is_int(self.seed):
            raise ValueError(f"SamplingParams.seed must be an integer or None, got {self.seed!r}")
        mst = self.max_sequence_tokens
        if mst is not None and (not is_int(mst) or mst < 2):
            raise ValueError(f"SamplingParams.max_sequence_tokens must be an integer >= 2 or None, got {mst!r}")
        if isinstance(self.stop_strings, str):
            raise ValueError(f"SamplingParams.stop_strings must be a tuple of strings, got {self.stop_strings!r}")
        strings = tuple(self.stop_strings)
        if not all(isinstance(x, str) and x for x in strings):
            raise ValueError(f"SamplingParams.stop_strings must be non-empty strings, got {self.stop_strings!r}")
        object.__setattr__(self, "stop_strings", strings)
        if not is_int(self.max_turns) or self.max_turns < 1:
            raise ValueError(f"SamplingParams.max_turns must be an integer >= 1, got {self.max_turns!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def context(self, max_positions: int) -> int:
        """Most tokens one sequence (prompt, every turn, every observation) may reach: ``max_sequence_tokens``
        within the model's context of ``max_positions`` positions."""
        return min(self.max_sequence_tokens or max_positions, max_positions)

    def response_limit(self, length: int, context: int) -> int:
        """The length rule of every turn, first or later, single- or multi-turn: a sequence of ``length`` tokens
        may sample ``min(max_new_tokens, context - length)`` more in its next turn, ``context`` being
        :meth:`context` (may be < 1: no room)."""
        return min(self.max_new_tokens, context - length)


FINISH_REASONS = ("stop", "length", "max_turns", "env_done", "error")
HANDLER_FINISH_REASONS = ("stop", "env_done", "error")  # the ones a turn handler may end a trajectory with


@dataclass
class Completion:
    """One trajectory of a prompt (the prompt itself is not included): one turn, or, multi-turn, the sampled turns
    with the appended observations between them."""

    token_ids: list[int]
    """Everything after the prompt, in order: sampled turns and appended observations. A sampled turn ends with its
    stop token, or at the token that completes a stop string, when it ended at a boundary."""
    logprobs: list[float] = field(repr=False)
    """Aligned with token_ids: log p(token) under softmax(logits / temperature) before top-p/top-k truncation
    (temperature 1 for greedy) at sampled tokens, 0.0 at appended ones."""
    finish_reason: str
    """"stop" (an eos/stop token or stop string ended it, or the turn handler said "stop"), "length" (a turn's
    max_new_tokens, the max_sequence_tokens budget, or an observation that did not fit it), "max_turns" (the handler
    answered the max_turns-th turn with an observation), "env_done" or "error" (the turn handler's reasons)."""
    loss_mask: list[int] | None = field(default=None, repr=False)
    """Aligned with token_ids: 1 where the policy sampled the token, 0 where it was appended (None when constructed:
    every token, a single sampled turn)."""
    num_turns: int = 1
    """Sampled turns (1 for single-turn)."""
    versions: list[int] | None = field(default=None, repr=False)
    """Aligned with token_ids, from a generation session (``GenerationEngine.session``): the version of the weights
    each token was sampled with (an appended token: its last sampled token's); None from ``generate``."""
    routing: torch.Tensor | None = field(default=None, repr=False)
    """A mixture-of-experts model's router replay record (``GenerationEngine(record_routing=True)``): ``[prompt +
    completion tokens, MoE layers, top_k]`` expert ids each token was routed to (uint8 when E ≤ 255, else int16; E
    where none was recorded: the last token, never fed); None otherwise (``fastgrpo.engine.moe``)."""

    def __post_init__(self):
        if self.loss_mask is None:
            self.loss_mask = [1] * len(self.token_ids)


@dataclass(frozen=True)
class TurnResult:
    """A turn handler's answer for a sample that paused at a turn boundary."""

    append_ids: list[int]
    """Tokens to append after the sampled turn (observation + template suffix through the next assistant generation
    prompt); prefilled into the sample's own pages, then decoding resumes."""
    stop_strings: tuple[str, ...] | None = None
    """The sample's stop strings from now on (None: keep)."""
    finish: str | None = None
    """Not None: the trajectory ends now with this finish reason ("stop", "env_done" or "error"); append_ids are
    ignored."""


class TurnHandler(Protocol):
    """What ``GenerationEngine.generate(..., turns=)`` calls at turn boundaries (an environment, tools, a script)."""

    def start(self, key: tuple[int, int], turn_ids: list[int], turn_text: str) -> None:
        """Sample ``key`` = (prompt index, sample index) ended a turn at EOS, a stop token or a stop string.
        ``turn_ids``: the tokens it sampled this turn (trimmed exactly at the stop string; the EOS/stop token
        included when one ended it); ``turn_text``: their decoding. Must not block (work goes to a worker)."""

    def ready(self, block: bool) -> list[tuple[tuple[int, int], TurnResult]]:
        """The results available now; ``block=True``: wait until at least one is (the engine asks so only when no
        sample is decoding)."""


def use_fused_sampling(t: torch.Tensor) -> bool:
    """Temperature-only sampling by the Triton kernel on CUDA; torch ops elsewhere (and for top-k/top-p)."""
    return t.is_cuda and use_triton(t)


def _mix31(x: torch.Tensor) -> torch.Tensor:
    """An integer hash of int64 values in [0, 2^31) onto [0, 2^31) (xor-shift-multiply; no overflow in int64)."""
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & SEED_MASK
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & SEED_MASK
    return x ^ (x >> 16)


def sample_streams(seed: int, sample_S: torch.Tensor) -> torch.Tensor:
    """The key of each sample's random stream, a hash of (call seed, sample id): computed once when a sample takes
    its row, so that a decode step hashes only the token index (``row_seeds``)."""
    return _mix31(_mix31(torch.full_like(sample_S, seed & SEED_MASK)) ^ sample_S)


def row_seeds(stream_S: torch.Tensor, index_S: torch.Tensor) -> torch.Tensor:
    """The seed of each row's next draw: a hash of (call seed, sample id, index of the token being drawn), from the
    sample's stream key, on the rows' device (no host sync). A sample's noise is then the same whatever batch or row
    it runs in."""
    return _mix31(stream_S ^ index_S)


def row_uniforms(seeds_S: torch.Tensor) -> torch.Tensor:
    """One uniform in [0, 1) per row, fp64 with 53 random bits, from the row's stream (``row_seeds``): the high 31
    bits are the seed itself, the low 22 a second hash of it. On the rows' device, no host sync."""
    low = _mix31(seeds_S ^ 0x2545F491) >> 9  # 22 bits
    return ((seeds_S << 22) | low).double() * 2.0**-53


def stream_uniforms(stream_A: torch.Tensor, t0_A: torch.Tensor, width: int) -> torch.Tensor:
    """``[A, width]`` fp64: the uniforms of draws ``t0 .. t0 + width − 1`` of each stream (``row_uniforms`` of
    ``row_seeds``, the same values). The engine's CPU rows keep this table, filled when a sample takes its row, so
    that a decode step reads its rows' uniforms in one indexing op instead of ~30 ops of hashing (8 bytes a row and
    token of the response limit)."""
    index_AW = t0_A[:, None] + torch.arange(width, device=t0_A.device)
    return row_uniforms(row_seeds(stream_A[:, None], index_AW))


def sample_tokens(logits_SV: torch.Tensor, params: SamplingParams, seeds_S: torch.Tensor | None, u_S=None,
                  batch_invariant: bool = False):
    """Draw one token per row (row r from its stream ``seeds_S[r]``); returns (token [S] int64, log-prob [S] fp32
    before top-p/top-k truncation). ``logits_SV`` is consumed: the unfused path works in place on it.

    On CUDA (the Triton kernels) the draw is Gumbel-max over the row's uniforms ``U(seed, v)``; elsewhere it is the
    inverse CDF with one uniform per row (``inverse_cdf_sample``): the same distribution, no ``[S, V]`` noise. That
    uniform is ``row_uniforms(seeds_S)``, or ``u_S`` when the caller has it (the engine's table,
    ``stream_uniforms``: the same values; ``seeds_S`` may then be None).

    ``batch_invariant`` (``numerics.batch_invariant``): the same draw, and the log-prob is
    ``logits[token] / T − logsumexp_tiles(logits / T)`` (``fastgrpo.kernels.batch_invariant``: the LM head's fixed
    vocabulary tiles, the trainer's log-prob bit for bit; T = 1 when greedy), read from a copy of the logits."""
    if batch_invariant:
        inv_temp = 1.0 if params.greedy else 1.0 / params.temperature
        lse_S = logsumexp_tiles(logits_SV, inv_temp)
        kept_SV = logits_SV.clone()
        tok, _ = sample_tokens(logits_SV, params, seeds_S, u_S)
        return tok, token_logprobs(kept_SV, tok, inv_temp, lse_S)
    if u_S is None and not params.greedy and not use_fused_sampling(logits_SV):
        u_S = row_uniforms(seeds_S)
    if params.greedy:
        logp = torch.log_softmax(logits_SV, dim=-1)
        tok = logits_SV.argmax(dim=-1)
        return tok, logp.gather(1, tok[:, None]).squeeze(1)
    fused = use_fused_sampling(logits_SV)
    plain = not params.top_k and params.top_p == 1.0
    if plain and fused:
        return gumbel_sample(logits_SV, params.temperature, seeds_S)
    if plain:  # w = exp(x − max x) in place, x = logits / T; log p[token] = log w[token] − log Σ w
        w_SV = logits_SV if params.temperature == 1.0 else logits_SV.div_(params.temperature)
        w_SV.sub_(w_SV.amax(dim=-1, keepdim=True)).exp_()
        tok, total = inverse_cdf_sample(w_SV, u_S)
        return tok, (w_SV.gather(1, tok[:, None]).squeeze(1).double().log() - total.log()).float()
    logp = torch.log_softmax(logits_SV / params.temperature, dim=-1)  # [S, V]
    kept = logp
    if params.top_k and params.top_k < logp.shape[-1]:
        kth = torch.topk(logp, params.top_k, dim=-1).values[:, -1:]  # [S, 1]
        kept = kept.masked_fill(logp < kth, -math.inf)
    if params.top_p < 1.0:
        sorted_lp, order = torch.sort(kept, dim=-1, descending=True)
        probs = torch.softmax(sorted_lp, dim=-1)  # renormalised over what top-k kept
        mass_before = probs.cumsum(dim=-1) - probs  # mass of the strictly more likely tokens
        drop = mass_before >= params.top_p  # the first token always stays (mass_before = 0 < top_p)
        kept = kept.scatter(1, order, sorted_lp.masked_fill(drop, -math.inf))
    if fused:  # Gumbel(0, 1) noise −log(−log u) from the kernel's uniforms (philox, no host sync)
        u = uniform_rows(seeds_S, kept.shape[-1])  # [S, V]
        tok = (kept - (-u.log()).log()).argmax(dim=-1)
    else:  # the truncated tokens have weight exp(−inf) = 0: never drawn
        tok, _ = inverse_cdf_sample(kept.exp(), u_S)
    return tok, logp.gather(1, tok[:, None]).squeeze(1)
