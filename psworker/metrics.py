"""Evaluation metrics of a binary classifier over numpy arrays (pure): AUC and logloss."""

from __future__ import annotations

import numpy as np


def auc(scores, labels) -> float:
    """Area under the ROC curve (the Mann-Whitney statistic, ties counted half); 0.5 when one class is absent."""
    scores, labels = np.asarray(scores, np.float64), np.asarray(labels).astype(bool)
    pos, neg = int(labels.sum()), int((~labels).sum())
    if pos == 0 or neg == 0:
        return 0.5
    order = np.argsort(scores, kind="mergesort")
    sorted_scores = scores[order]
    starts = np.r_[0, np.flatnonzero(np.diff(sorted_scores)) + 1]
    ends = np.r_[starts[1:], len(scores)]
    mean_rank = (starts + ends + 1) / 2.0          # ties share their mean rank (1-based)
    ranks = np.empty(len(scores), np.float64)
    ranks[order] = np.repeat(mean_rank, ends - starts)
    return float((ranks[labels].sum() - pos * (pos + 1) / 2.0) / (pos * neg))


def logloss(probabilities, labels, eps: float = 1e-7) -> float:
    """Mean binary cross-entropy of `probabilities` (of label 1) against 0/1 `labels`."""
    p = np.clip(np.asarray(probabilities, np.float64), eps, 1.0 - eps)
    y = np.asarray(labels, np.float64)
    return float(-np.mean(y * np.log(p) + (1.0 - y) * np.log(1.0 - p)))


__all__ = ["auc", "logloss"]
