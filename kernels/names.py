"""The names of the losses' option values, in one place and without torch: the kernels check their keywords against
them, and ``fastgrpo.config`` its fields (a reward worker imports the config and never torch).

- ``LOSS_TYPES``: TRL 1.16's ``loss_type`` values ``grpo_loss`` computes. ``LOSS_POLICY`` gives each one's per-token
  policy term (clipped, cispo, cispo_clamp, sapo) and ``LOSS_REDUCTION`` its normalisation (``REDUCTIONS``; TRL's
  ``_compute_loss``: sapo reduces as grpo, cispo and cispo_clamp as dapo, luspo as dr_grpo with a length of 1);
  ``CLIPPED_LOSS_TYPES`` are the ones with the clipped term, the only ones ``delta`` and ``dual_clip_c`` apply to.
- ``IS_LEVELS``: the importance ratio per token or per sequence (GSPO).
- ``KL_ESTIMATORS`` k1 / k2 / k3 (Schulman's approximations, NeMo-RL's ``reference_policy_kl_type``);
  ``KL_WEIGHTS`` none / ratio / score / sampling_ratio (the factor on the per-token KL, see ``grpo_loss.py``).
- ``ROLLOUT_IS_MODES``: the rollout importance-sampling modes of ``rollout_is.py``, with NeMo-RL's names
  ``ROLLOUT_IS_ALIASES`` for two of TRL's.
- ``DPO_LOSS_TYPES``: ``dpo_loss``'s ``loss_type`` values.
"""

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo", "sapo", "cispo", "cispo_clamp")
REDUCTIONS = ("grpo", "bnpo", "dr_grpo", "dapo")  # the GRPO finaliser's LOSS_TYPE switch, in this order
LOSS_REDUCTION = {"grpo": "grpo", "bnpo": "bnpo", "dr_grpo": "dr_grpo", "dapo": "dapo", "luspo": "dr_grpo",
                  "sapo": "grpo", "cispo": "dapo", "cispo_clamp": "dapo"}
LOSS_POLICY = {"grpo": "clipped", "bnpo": "clipped", "dr_grpo": "clipped", "dapo": "clipped", "luspo": "clipped",
               "sapo": "sapo", "cispo": "cispo", "cispo_clamp": "cispo_clamp"}
CLIPPED_LOSS_TYPES = tuple(t for t in LOSS_TYPES if LOSS_POLICY[t] == "clipped")
IS_LEVELS = ("token", "sequence")
KL_ESTIMATORS = ("k1", "k2", "k3")
KL_WEIGHTS = ("none", "ratio", "score", "sampling_ratio")
ROLLOUT_IS_ALIASES = {"tis": "token_truncate", "icepop": "token_mask"}  # NeMo-RL's names for TRL's modes
ROLLOUT_IS_MODES = ("none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask", "seq-mask-tis",
                    *ROLLOUT_IS_ALIASES)
DPO_LOSS_TYPES = ("sigmoid", "ipo", "hinge")
