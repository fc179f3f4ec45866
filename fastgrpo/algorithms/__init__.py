"""The training algorithms on the shared loop: GRPO (and its DAPO / Dr. GRPO variants), DPO, SFT and on-policy
distillation. Each receives a declared context from the trainer; the shared pieces (batch types, the packed
forward, micro-batching, clip-and-step) are public modules here. Map: ``docs/architecture.md``."""
