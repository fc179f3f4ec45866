"""Datasets: prompt sets for rollouts (files, Hugging Face datasets, the built-in tasks), preference pairs and
supervised rows, and the samplers that order them across ranks and resumes."""
