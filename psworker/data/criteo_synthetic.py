"""A synthetic Criteo set (`psworker data criteo-synthetic`): files in exactly Criteo's format with a planted signal.

Each categorical column draws its values from a Zipf law (exponent `ZIPF_EXPONENT`) over `min(Criteo's
cardinality, max_cardinality)` distinct hex ids, so a few columns are large and most small, as in Criteo. Some
columns leave a share of their fields empty, integers and categoricals alike. The label is drawn from
`sigmoid(logit)`, where the logit is a bias plus a weight per value of the planted categorical columns
(`PLANTED_CATS`) plus a weight times the planted integer's log (`PLANTED_INT`); every other feature is noise. The
generator knows each line's true click probability, so it reports the best AUC any model can reach on the held-out
day (`oracle_auc` in `criteo_synthetic.json`): a model that learns the planted features gets near it, one that
learns nothing gets 0.5.
"""

from __future__ import annotations

import gzip
import json
import os
from dataclasses import asdict, dataclass
from typing import Optional

import numpy as np

from psworker.data import criteo
from psworker.metrics import auc

ZIPF_EXPONENT = 1.1
PLANTED_CATS = (0, 5, 8, 13, 19)   # columns C1, C6, C9, C14, C20: 1,460, 24, 3, 27 and 4 values in Criteo
PLANTED_INT = 0                    # I1
PLANTED_WEIGHT_SPREAD = 1.5        # each planted value's weight: normal, this standard deviation
INT_WEIGHT = 1.0                   # the planted integer's weight per unit of standardised log(1 + value)
BIAS = -2.0
META_FILE = "criteo_synthetic.json"
DEFAULT_DAYS = 3
DEFAULT_ROWS_PER_DAY = 4000
DEFAULT_MAX_CARDINALITY = 10_000


@dataclass(frozen=True)
class SyntheticInfo:
    """What `write_synthetic` wrote (also `criteo_synthetic.json`)."""

    files: tuple[str, ...]
    rows_per_day: int
    cardinalities: tuple[int, ...]
    click_rate: float        # the share of label 1 over every day
    oracle_auc: float        # AUC of the true click probabilities on the held-out (last) day


def _hex_ids(column: int, ranks: np.ndarray) -> list[str]:
    """Rank -> an 8-digit hex id, distinct per rank within a column (an odd multiplier is a bijection mod 2^32);
    -1 -> '' (empty). Each distinct rank is formatted once."""
    distinct, back = np.unique(ranks, return_inverse=True)
    ids = (distinct.astype(np.uint64) * np.uint64(0x9E3779B1) + np.uint64(column * 0x85EBCA77)) & np.uint64(0xFFFFFFFF)
    text = np.array(["" if r < 0 else f"{i:08x}" for r, i in zip(distinct.tolist(), ids.tolist())], dtype=object)
    return text[back.reshape(-1)].tolist()


def _zipf_ranks(rng: np.random.Generator, cardinality: int, n: int) -> np.ndarray:
    cdf = np.cumsum(1.0 / np.arange(1, cardinality + 1) ** ZIPF_EXPONENT)
    return np.minimum(np.searchsorted(cdf / cdf[-1], rng.random(n)), cardinality - 1)


def _day(rng: np.random.Generator, weights: dict, cards: tuple[int, ...], n: int):
    """One day's `(labels, ints (None: empty), categorical ranks (-1: empty), true probabilities)`."""
    ints = np.floor(rng.lognormal(mean=1.0 + np.arange(criteo.NUM_INT) % 3, sigma=1.5,
                                  size=(n, criteo.NUM_INT))).astype(np.int64)
    ints[:, 1] -= (rng.random(n) < 0.05).astype(np.int64) * (ints[:, 1] + 1)   # I2 holds -1 now and then, as in Criteo
    int_empty = rng.random((n, criteo.NUM_INT)) < np.where(np.arange(criteo.NUM_INT) % 3 == 2, 0.2, 0.0)
    ranks = np.stack([_zipf_ranks(rng, c, n) for c in cards], axis=1)
    cat_empty = rng.random((n, criteo.NUM_CAT)) < np.where(np.arange(criteo.NUM_CAT) % 4 == 3, 0.15, 0.0)
    cat_empty[:, list(PLANTED_CATS)] = False
    int_empty[:, PLANTED_INT] = False
    logit = np.full(n, BIAS)
    for column in PLANTED_CATS:
        logit += weights[column][ranks[:, column]]
    log_int = np.log1p(np.maximum(ints[:, PLANTED_INT], 0))
    logit += INT_WEIGHT * (log_int - 1.0) / 1.5   # about standardised: the column is lognormal(1.0, 1.5)
    prob = 1.0 / (1.0 + np.exp(-logit))
    labels = (rng.random(n) < prob).astype(np.int64)
    return labels, np.where(int_empty, None, ints), np.where(cat_empty, -1, ranks), prob


def _lines(labels, ints, ranks) -> list[str]:
    columns = [[str(v) for v in labels.tolist()]]
    columns += [["" if v is None else str(v) for v in ints[:, j].tolist()] for j in range(criteo.NUM_INT)]
    columns += [_hex_ids(c, ranks[:, c]) for c in range(criteo.NUM_CAT)]
    return [line + "\n" for line in map("\t".join, zip(*columns))]


def write_synthetic(data_dir: str, *, days: int = DEFAULT_DAYS, rows_per_day: int = DEFAULT_ROWS_PER_DAY,
                    max_cardinality: int = DEFAULT_MAX_CARDINALITY, compress: bool = False,
                    seed: Optional[int] = 0) -> SyntheticInfo:
    """Writes `day_0` .. `day_<days-1>` (`.gz` when `compress`) into `data_dir` and `criteo_synthetic.json`.

    The last day is the held-out split (`criteo.split_files`). Deterministic for a given seed.
    """
    if days < 2 or rows_per_day < 1 or max_cardinality < 1:
        raise ValueError("criteo-synthetic needs at least 2 days, 1 row per day and a cardinality of at least 1")
    os.makedirs(data_dir, exist_ok=True)
    cards = tuple(min(c, max_cardinality) for c in criteo.CARDINALITIES)
    weight_rng = np.random.default_rng([0 if seed is None else seed, 1])
    weights = {c: weight_rng.normal(0.0, PLANTED_WEIGHT_SPREAD, cards[c]) for c in PLANTED_CATS}
    rng = np.random.default_rng([0 if seed is None else seed, 2])
    files, clicks, oracle = [], 0, 0.5
    for day in range(days):
        labels, ints, ranks, prob = _day(rng, weights, cards, rows_per_day)
        path = os.path.join(data_dir, f"day_{day}" + (".gz" if compress else ""))
        with (gzip.open(path, "wt", encoding="ascii") if compress else open(path, "w", encoding="ascii")) as f:
            f.writelines(_lines(labels, ints, ranks))
        files.append(path)
        clicks += int(labels.sum())
        if day == days - 1:   # the held-out split
            oracle = auc(prob, labels)
    info = SyntheticInfo(tuple(files), rows_per_day, cards, clicks / (days * rows_per_day), round(oracle, 4))
    with open(os.path.join(data_dir, META_FILE), "w", encoding="utf-8") as f:
        json.dump(asdict(info), f, indent=1)
    return info


def read_info(data_dir: str) -> SyntheticInfo:
    """The `criteo_synthetic.json` that `write_synthetic` left in `data_dir`."""
    with open(os.path.join(data_dir, META_FILE), encoding="utf-8") as f:
        raw = json.load(f)
    return SyntheticInfo(tuple(raw["files"]), raw["rows_per_day"], tuple(raw["cardinalities"]), raw["click_rate"],
                         raw["oracle_auc"])


__all__ = ["write_synthetic", "read_info", "SyntheticInfo", "PLANTED_CATS", "PLANTED_INT", "META_FILE"]
