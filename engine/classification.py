"""A sequence classifier's probabilities from its logits (engine/pooling.py gives the
logits): numpy only, so that the API processes, which never load torch, use it too."""

from __future__ import annotations

import numpy as np


def class_probabilities(logits: np.ndarray) -> np.ndarray:
    """[n, labels] a classifier's logits -> their softmax per row, or with one label their
    sigmoid (a reward or relevance score), as vLLM's classify does."""
    logits = logits.astype(np.float64)
    if logits.shape[1] == 1:
        return 1.0 / (1.0 + np.exp(-logits))
    shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
    return shifted / shifted.sum(axis=1, keepdims=True)
