"""Datasets: prompt sets for rollouts (files, Hugging Face datasets, the built-in tasks), preference pairs and
supervised rows, and the samplers that order them across ranks and resumes.

- :mod:`fastgrpo.data.prompts`: prompt datasets (files, Hugging Face datasets, the built-in task), their
  tokenisation and :class:`~fastgrpo.data.prompts.PromptSampler`.
- :mod:`fastgrpo.data.synthetic`: the built-in tasks' rows (``add``, ``sliding_puzzle``) and their fixed split.
- :mod:`fastgrpo.data.puzzle_boards`: the sliding puzzle's boards (shared with the game environment).
- :mod:`fastgrpo.data.responses`: preference pairs (dpo) and supervised examples (sft), from every supported format.
- :mod:`fastgrpo.data.tool_tiny`: the tool-tiny demo's demonstrations and warm-up.
"""
